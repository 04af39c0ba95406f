"""A real Slurm cluster on loopback: one slurmctld and several ``slurmd -N`` on this host: bringing it up,
watching it, taking it down (the files it runs on are in files.py, its record in state.py).

Everything lives under one directory; ``cluster.json`` records exactly which processes ``up``
started (PID and the executable they must still be), so ``down`` stops those and nothing else.
Emulated GPUs are character devices with NVIDIA's numbers (``make_gpu_devices``), and jobs run in
device cgroups (task/cgroup, ConstrainDevices=yes) as at a GPU site: a job can open exactly the GPUs
Slurm, or for an opportunistic job slurm-antman, gave it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

import yaml

from slurm_antman.admin import agent_bundle, site_settings
from slurm_antman import config as config_mod
from slurm_antman.admin.render import RenderOptions, write_all
from slurm_antman.slurm import version as slurm_version

from .dirs import DEFAULT_DIR
from .files import (
    COORDINATOR_PORT_OFFSET, DEFAULT_PORT_BASE, REPO, _base_slurm_conf, _merge, _which,
    build_spank, cgroup_conf as files_cgroup_conf, dev_config, make_gpu_devices, run_dir, sidecar_socket_dir,
    slurmd_spool_dir, systemd_running, topology_conf, unified_cgroup_host,
)
from .hosts import DEV_USER, Hosts, ensure_user, let_users_through  # noqa: F401 - DEV_USER: dc.DEV_USER
from .processes import DevclusterError, Proc, _descendants, delegated_scope, _ensure_munged, _reap, _spawn
from .state import Cluster, _enter, _shape_file, _state_file, is_running, load, running, shape_differences


def up(d: Path = DEFAULT_DIR, nodes: int = 2, gpus: int = 4, cpus: int = 4, port_base: int = DEFAULT_PORT_BASE,
       plain: bool = False, timeout: float = 90, sidecars: bool = True, extra_slurm_conf: str = "",
       extra_etc_files: dict[str, str] | None = None, coordinator: bool = True,
       overrides: dict | None = None, accounting: bool = True, cgroups: bool = True,
       hosts: bool = False, installed: Optional[Path] = None,
       require: Optional[Iterable[str]] = None, site_scripts: bool = False, switches: int = 0,
       slurm_prefix: Optional[Path] = None) -> Cluster:
    """Start the cluster (or return the running one). ``extra_slurm_conf`` lines are appended to
    slurm.conf and ``extra_etc_files`` written into etc/ (benchmarks build variants with them).
    ``coordinator``: start the coordinator daemon (with CURVE keys for it and the sidecars);
    ``overrides``: antman.yaml fields on top of the devcluster's (see ``dev_config``); ``accounting``:
    run slurmdbd on a MariaDB of its own, the tenants as accounts (see devcluster.accounting);
    ``cgroups``: task/cgroup with ConstrainDevices=yes (cgroup.conf), on by default as at GPU sites;
    ``hosts``: every node a host of its own, in its own network namespace (see ``Hosts``);
    ``installed``: the PREFIX of a ``make install``: the daemons, the hooks, the SPANK plugin, the Lua
    scripts and the agent bundle come from it, as at a site, instead of from this checkout;
    ``require``: the arguments a cluster already running in ``d`` must have been started with for ``up``
    to return it (default: all of them; `antman devcluster up` names the flags given);
    ``site_scripts``: play a site with Lua scripts of its own: etc/examples/job_submit.lua and
    cli_filter.lua (site rules plus the one line calling slurm-antman's modules) instead of the plain ones;
    ``switches``: that many emulated leaf switches over the nodes (etc/topology.conf, TopologyPlugin=topology/tree;
    see ``files.topology_conf``); 0, the default, writes no topology;
    ``slurm_prefix``: run a Slurm carried into a prefix (``lab.devcluster.carried_slurm``: a bare GPU machine's)
    instead of the installed one: its daemons, commands, plugins, SPANK plugin build and its own munged.
    A node group whose ``gpu_files`` (``overrides``) lie outside the cluster's dev/ uses those devices as
    they are (a real GPU's /dev/nvidia0): no emulated ones are made."""
    # Every argument but these makes the cluster what it is (first: before any other local exists).
    shape = {k: v for k, v in locals().items() if k not in ("d", "timeout", "require")}
    d = Path(d).resolve()
    existing = load(d)
    if existing and is_running(existing):
        # `up` on a running cluster returns it, untouched: a second cluster in the same directory would
        # take its ports and files. Returned only as it was asked for: a caller that needs another shape
        # (the demo's one GPU, a test's overrides) must not run on this one unawares.
        differ = shape_differences(d, {k: v for k, v in shape.items() if require is None or k in require})
        if differ:
            raise DevclusterError(f"a cluster already runs in {d}, not as asked ({'; '.join(differ)}): stop it "
                                  f"first (antman devcluster down --dir {d}) or give another directory")
        return existing
    if existing:
        down(d)
    if nodes < 1 or gpus < 1:
        raise DevclusterError("--nodes and --gpus must be at least 1")
    if not 0 <= switches <= nodes:
        raise DevclusterError(f"--switches must be between 0 (no topology) and --nodes ({nodes}), not {switches}")
    carried = None
    if slurm_prefix is not None:
        from .carried_slurm import Prefix

        carried = Prefix(Path(slurm_prefix).resolve())
        # Every Slurm command this process and its children run (the version check below, the hooks'
        # PATH, the daemons' own calls) finds the carried wrappers first.
        os.environ["PATH"] = carried.env()["PATH"]
    # Before anything is written: a Slurm outside the supported range is one line naming both.
    version = slurm_version.check_supported(slurm_version.installed_version(commands=slurm_version.DAEMON_FIRST))
    if accounting:
        from . import accounting as acct

        missing = acct.missing_binaries()
        if missing:
            raise DevclusterError(f"accounting needs {', '.join(missing)}: install mariadb-server and slurmdbd "
                                  "(make deps), or start without accounting (--no-accounting)")
    # A fresh cluster every time: job ids from 1, no sidecar job records or env files of jobs that
    # ran on an earlier cluster in this directory.
    # The logs go too: the coordinator's audit log is keyed by job id, and an earlier cluster's records
    # would be told as this cluster's jobs' story.
    for sub in ("state", "run", "antman-state", "log"):
        shutil.rmtree(d / sub, ignore_errors=True)
    shutil.rmtree(run_dir(port_base), ignore_errors=True)
    run_dir(port_base).mkdir(parents=True, exist_ok=True)  # a tmpfs the fault bench mounted stays
    run_dir(port_base).chmod(0o755)  # the jobs' agents reach their sockets below
    for sub in ("etc", "dev", "state/ctld", "log", "run", "lib", "antman-state"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    _shape_file(d).write_text(json.dumps(shape, indent=2, default=str))
    ensure_user()
    # The user's jobs open the GPUs in dev/ and their agents the sidecar sockets in run/, as on a
    # site's /dev and /run: the directories on the way must let them through (read and write stays
    # root's).
    let_users_through(d)
    for path in (d / "dev", d / "run", d / "etc"):
        path.chmod(0o755)

    antman_command = f"{sys.executable} -m slurm_antman.cli"
    install = None
    if installed is not None:
        install = json.loads((Path(installed) / "share" / "slurm-antman" / "install.json").read_text())
        antman_command = install["bin"]
        overrides = _merge({"plugin_path": install["plugin"], "agent_path": install["agent"]}, overrides or {})
    if hosts:
        host_names = config_mod.NodeGroup(name=f"node[1-{nodes}]" if nodes > 1 else "node1", gpus=1).hosts
        the_hosts = Hosts(f"antman{port_base}", host_names)
        # The sidecars report across the bridge, to the coordinator's address in the controller's namespace.
        overrides = _merge({"coordinator": {
            "endpoint": f"tcp://{the_hosts.addr('ctl')}:{port_base + COORDINATOR_PORT_OFFSET}"}}, overrides or {})
    raw = dev_config(d, nodes, gpus, cpus, antman_command, port_base, overrides)
    if all(str(g.get("gpu_files", "")).startswith(str(d / "dev")) for g in raw["nodes"]):
        make_gpu_devices(d / "dev", gpus)
    (d / "antman.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = config_mod.load(d / "antman.yaml")
    # Every node of every node group (a test may give several, e.g. of two GPU types).
    cluster = Cluster(d, [h for g in cfg.nodes for h in g.hosts], gpus, port_base, plain, accounting=accounting,
                      hosts=the_hosts if hosts else None, installed=str(installed) if installed else None,
                      slurm_prefix=str(carried.path) if carried else None)
    if cluster.hosts is not None:
        node_params = {h: f"Port={port_base + 1 + i} NodeAddr={cluster.hosts.addr(h)} NodeHostname={h}"
                       for i, h in enumerate(cluster.nodes)}
    else:
        node_params = {h: f"Port={port_base + 1 + i} NodeHostname=localhost" for i, h in enumerate(cluster.nodes)}
    opts = RenderOptions(config_path=str(d / "antman.yaml"), hook_dir=str(d / "etc"),
                         slurm_conf=str(cluster.slurm_conf), with_antman=not plain, node_params=node_params,
                         slurm_bin=slurm_version.commands_dir())
    write_all(cfg, d / "etc", opts)
    acct_lines = None
    if accounting:
        acct.prepare(d, port_base)
        acct_lines = acct.slurm_conf_lines(port_base, (cfg.slurm.gpu_gres,),
                                           cluster.hosts.addr("ctl") if cluster.hosts is not None else "localhost")
    ctl_addr = cluster.hosts.addr("ctl") if cluster.hosts is not None else None
    # The devcluster plays a site with slurm.conf settings of its own, and merges what slurm-antman needs
    # into them as docs/admin.md tells an admin to (antman config merge-slurm-conf): never overwritten.
    site_conf = _base_slurm_conf(d, port_base, not plain, acct_lines, version, cgroups, ctl_addr, topology=switches > 0,
                                 carried=carried.slurm_conf_lines() if carried else ())
    merged = site_settings.merge_text(site_conf, site_settings.needs(cfg, str(d / "etc"), with_antman=not plain),
                                      many_prologs=slurm_version.many_prolog_lines(version))
    if merged.conflicts:
        raise DevclusterError("the devcluster's slurm.conf conflicts with what slurm-antman needs: "
                              + "; ".join(merged.conflicts))
    (d / "etc" / "slurm.conf").write_text(merged.text + extra_slurm_conf)
    topology = d / "etc" / "topology.conf"
    if switches:
        topology.write_text(topology_conf(cluster.nodes, switches))
    else:
        topology.unlink(missing_ok=True)
    cgroup_conf = d / "etc" / "cgroup.conf"
    unified, systemd = unified_cgroup_host(), systemd_running()
    if cgroups or (unified and not systemd):
        cgroup_conf.write_text(files_cgroup_conf(unified, systemd, constrain=cgroups))
    else:
        cgroup_conf.unlink(missing_ok=True)
    for h in cluster.nodes:  # 24.11's slurmd does not make its spool directory (22.05's does)
        slurmd_spool_dir(port_base, h).mkdir(parents=True, exist_ok=True)
    for name, text in (extra_etc_files or {}).items():
        (d / "etc" / name).write_text(text)
    if plain:
        (d / "etc" / "plugstack.conf").write_text("# plain Slurm: no SPANK plugins\n")
    else:
        (d / "etc" / "plugstack.conf").write_text(f"include {d}/etc/plugstack.conf.d/antman.conf\n")
        # The Lua scripts as a site copies them beside slurm.conf: from the install, or this checkout.
        lua = Path(installed) / "share" / "slurm-antman" / "lua" if installed else REPO / "etc"
        # Every one of them: the scripts and the modules they load (an older install has no modules).
        for script in sorted(lua.glob("*.lua")):
            shutil.copy2(script, d / "etc" / script.name)
        if site_scripts:  # a site's own scripts, each with the one line that calls slurm-antman's module
            for name in ("job_submit.lua", "cli_filter.lua"):
                shutil.copy2(REPO / "etc" / "examples" / name, d / "etc" / name)
        if not installed:  # an install brings its own plugin and agent bundle
            if carried is not None and carried.spank_plugin is not None:  # built where its headers were
                (d / "lib").mkdir(parents=True, exist_ok=True)
                shutil.copy2(carried.spank_plugin, d / "lib" / "antman_spank.so")
            else:
                build_spank(d / "lib" / "antman_spank.so")
            if cfg.agent_path:
                agent_bundle.build(Path(cfg.agent_path))

    env = _daemon_env(cluster)
    if carried is None:
        _ensure_munged(cluster.procs)
    try:
        _record(cluster, None)
        if carried is not None:
            from .carried_slurm import munged_program, start_munged

            _record(cluster, Proc("munged", start_munged(carried, d / "log" / "munged.log"), str(munged_program(carried))))
        if cluster.hosts is not None:
            cluster.hosts.create()
        if accounting:
            _record(cluster, acct.start_mariadb(cluster, env))
            _record(cluster, acct.start_slurmdbd(cluster, env))
        _record(cluster, start_slurmctld(cluster, env, clear_state=True))
        for h in cluster.nodes:
            _record(cluster, start_slurmd(cluster, h, env))
        if accounting:
            acct.add_tenants(cluster, cfg.tenants, cfg.slurm.gpu_gres)
        if not plain and (sidecars or coordinator):
            from slurm_antman import curve_keys as coord_keys

            # `antman keys init` for this cluster: the coordinator admits exactly these sidecars
            coord_keys.init_keys(cfg.coordinator.key_dir, cluster.nodes)
        if coordinator and not plain:
            _record(cluster, start_coordinator(cluster, env))
        if sidecars and not plain:
            for h in cluster.nodes:
                _record(cluster, start_sidecar(cluster, h, env))
        wait_ready(cluster, timeout)
    except BaseException:
        down(d)
        raise
    return cluster


def _record(cluster: Cluster, proc: Proc | None) -> None:
    """Add ``proc`` and write cluster.json at once, so that a start failing half-way is undone by
    ``down`` (it stops exactly what cluster.json names)."""
    if proc is not None:
        cluster.procs.append(proc)
    _state_file(cluster.dir).write_text(json.dumps(cluster.to_json(), indent=2))


def _daemon_env(cluster: Cluster) -> dict:
    env = cluster.env
    if cluster.slurm_prefix:
        from .carried_slurm import Prefix

        # The daemons are started as themselves (their PID is the program's, as ``down`` checks), not
        # through the wrappers: they get the carried libraries here.
        lib = Prefix(Path(cluster.slurm_prefix)).library_path()
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    if cluster.installed:
        env.pop("PYTHONPATH", None)  # the install's own packages, never this checkout's
    else:
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def daemon_python(cluster: Cluster) -> str:
    """The interpreter the antman daemons run with: this one, or the installed release's. The
    release is resolved now (PREFIX/current is a link an upgrade switches): a running daemon must not
    import the next release's modules half-way."""
    if cluster.installed:
        return str((Path(cluster.installed) / "current").resolve() / "venv" / "bin" / "python")
    return sys.executable


def start_slurmctld(cluster: Cluster, env: dict | None = None, clear_state: bool = False) -> Proc:
    """Start slurmctld; ``clear_state`` on a new cluster only: a restart (after a fault) recovers
    its jobs from StateSaveLocation, as a site's slurmctld does."""
    env = env if env is not None else _daemon_env(cluster)
    argv = [_daemon(cluster, "slurmctld"), "-D", *(["-c"] if clear_state else []), "-i"]
    return _spawn("slurmctld", argv, env, cluster.dir / "log" / "slurmctld.out", _enter(cluster, "ctl"))


def start_slurmd(cluster: Cluster, node: str, env: dict | None = None) -> Proc:
    """Start (or, after a kill, restart) ``node``'s slurmd, in a delegated scope where systemd runs it; a
    restarted slurmd registers with slurmctld afresh, as after a site's package upgrade."""
    env = env if env is not None else _daemon_env(cluster)
    # A new scope name each start: the old scope lives on while the job steps slurmd started run in it.
    unit = f"antman-dev-{cluster.port_base}-slurmd-{node}-{time.time_ns() // 1_000_000}"
    wrap = [*delegated_scope(unit), *(_enter(cluster, node) or [])]
    stepd = []
    if cluster.slurm_prefix:  # slurmd would look for its slurmstepd in /usr/sbin
        from .carried_slurm import Prefix

        stepd = ["-d", str(Prefix(Path(cluster.slurm_prefix)).slurmstepd)]
    return _spawn(f"slurmd:{node}", [_daemon(cluster, "slurmd"), "-D", "-N", node, *stepd], env,
                  cluster.dir / "log" / f"slurmd-{node}.out", wrap or None)


def _daemon(cluster: Cluster, name: str) -> str:
    """The program of Slurm's daemon ``name``: the carried one's, or the installed one's."""
    if cluster.slurm_prefix:
        from .carried_slurm import Prefix, daemon_program

        return str(daemon_program(Prefix(Path(cluster.slurm_prefix)), name))
    return _which(name)


def start_coordinator(cluster: Cluster, env: dict | None = None) -> Proc:
    """Start (or, after a kill, restart) the coordinator daemon; its log goes to log/coordinator.log."""
    env = env if env is not None else _daemon_env(cluster)
    return _spawn("coordinator", [daemon_python(cluster), "-m", "slurm_antman.coordinator.daemon", "--config",
                                  str(cluster.config_path)], env, cluster.dir / "log" / "coordinator.log",
                  _enter(cluster, "ctl"))


def start_sidecar(cluster: Cluster, node: str, env: dict | None = None) -> Proc:
    """Start (or, after a kill, restart) ``node``'s sidecar; its log goes to log/sidecar-NODE.log."""
    env = env if env is not None else _daemon_env(cluster)
    return _spawn(f"sidecar:{node}", [daemon_python(cluster), "-m", "slurm_antman.cli", "sidecar", "--config",
                                      str(cluster.config_path), "--node", node],
                  env, cluster.dir / "log" / f"sidecar-{node}.log", _enter(cluster, node))


def replace_proc(cluster: Cluster, proc: Proc) -> None:
    """Record ``proc`` in place of the process of the same name (after a restart), so ``down`` stops it."""
    cluster.procs = [p for p in cluster.procs if p.name != proc.name] + [proc]
    _state_file(cluster.dir).write_text(json.dumps(cluster.to_json(), indent=2))


def wait_ready(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    delay = 0.2
    while time.monotonic() < deadline:
        for p in cluster.procs:
            if not p.alive():
                raise DevclusterError(f"{p.name} (pid {p.pid}) exited; see {cluster.dir}/log/")
        r = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=20)
        last = r.stdout.strip() or r.stderr.strip()
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        if r.returncode == 0 and all(states.get(h, "").startswith(("idle", "mixed", "alloc")) for h in cluster.nodes):
            waiting = _sidecars_not_answering(cluster)
            if not waiting:
                return
            last = f"sidecar(s) of {', '.join(waiting)} not answering yet"
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    raise DevclusterError(f"cluster not ready after {timeout:.0f}s; last: {last}")


def _sidecars_not_answering(cluster: Cluster) -> list[str]:
    """Nodes whose sidecar was started but does not answer yet: a job started before then is refused
    by its Prolog (fail closed), so the cluster is not ready for jobs."""
    started = [p.name.split(":", 1)[1] for p in cluster.procs if p.name.startswith("sidecar:")]
    if not started:
        return []
    from slurm_antman.clients import sidecar_control as client

    cfg = config_mod.load(cluster.config_path)
    waiting = []
    for node in started:
        try:
            client.ping(cfg.node_socket_dir(node), timeout_s=1.0)
        except (client.SidecarUnreachable, client.SidecarError):
            waiting.append(node)
    return waiting


def down(d: Path = DEFAULT_DIR, timeout: float = 20) -> list[str]:
    """Stop exactly the processes ``up`` recorded: Slurm's daemons and ours first, then slurmdbd (it
    takes slurmctld's last records), then its database, munged last if we started it."""
    d = Path(d).resolve()
    cluster = load(d)
    if cluster is None:
        return []
    stopped = []
    if any(p.alive() for p in cluster.procs if p.name == "slurmctld"):
        _cancel_all_jobs(cluster, timeout)
    stage = {"slurmdbd": 1, "mariadb": 2, "munged": 3}
    order = sorted(cluster.procs, key=lambda p: {"munged": 2, "slurmctld": 1}.get(p.name, 0))
    for n in range(4):
        group = [p for p in order if stage.get(p.name, 0) == n]
        for p in group:
            if p.alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in group:
            while p.alive() and time.monotonic() < deadline:
                _reap(p.pid)
                time.sleep(0.1)
            if p.alive():
                os.kill(p.pid, signal.SIGKILL)
            _reap(p.pid)
            stopped.append(f"{p.name} ({p.pid})")
    # Steps outlive a stopped slurmd (slurmstepd daemonizes). Ours carry this cluster's SLURM_CONF.
    for pid in _orphan_steps(cluster):
        for victim in [pid, *_descendants(pid)]:
            try:
                os.kill(victim, signal.SIGKILL)
                stopped.append(f"slurmstepd-tree ({victim})")
            except ProcessLookupError:
                pass
    if cluster.hosts is not None:
        cluster.hosts.remove()
        stopped.append(f"network namespaces {cluster.hosts.prefix}-*")
    if not any(os.path.ismount(p) for p in (run_dir(cluster.port_base), sidecar_socket_dir(cluster.port_base))):
        shutil.rmtree(run_dir(cluster.port_base), ignore_errors=True)
    _state_file(d).unlink(missing_ok=True)
    _shape_file(d).unlink(missing_ok=True)
    return stopped


def _cancel_all_jobs(cluster: Cluster, timeout: float) -> None:
    """Cancel every job while slurmctld and slurmd still run, so job steps end the normal way."""
    r = cluster.run(["squeue", "-h", "-o", "%i"], timeout=30)
    ids = r.stdout.split() if r.returncode == 0 else []
    if not ids:
        return
    cluster.run(["scancel", *ids], timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = cluster.run(["squeue", "-h", "-o", "%i"], timeout=30)
        if r.returncode != 0 or not r.stdout.strip():
            return
        time.sleep(0.5)


def _orphan_steps(cluster: Cluster) -> list[int]:
    want = f"SLURM_CONF={cluster.slurm_conf}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if not f.read().startswith(b"slurmstepd"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


NODE_FORMAT = "%N|%T|%G|%P"


def node_lines(sinfo_out: str) -> list[str]:
    """One line per node from ``sinfo -h -N -o NODE_FORMAT``, which gives a line per node *and partition*
    (every devcluster node is in the guaranteed and the opportunistic partition): 'NODE STATE GRES
    (partitions P1,P2)', in sinfo's order of nodes."""
    nodes: dict[str, tuple[str, str, list[str]]] = {}
    for line in sinfo_out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        name, state, gres, partition = parts
        seen = nodes.setdefault(name, (state, gres, []))
        if partition not in seen[2]:
            seen[2].append(partition)
    # Sorted: sinfo's order of one node's partitions is not the same from one call to the next.
    return [f"{name} {state} {gres} (partitions {','.join(sorted(parts))})"
            for name, (state, gres, parts) in nodes.items()]


def status(d: Path = DEFAULT_DIR) -> dict:
    cluster = load(Path(d).resolve())
    if cluster is None:
        return {"running": False, "dir": str(d), "procs": []}
    procs = [{"name": p.name, "pid": p.pid, "alive": p.alive()} for p in cluster.procs]
    info = cluster.run(["sinfo", "-h", "-N", "-o", NODE_FORMAT], timeout=20)
    return {
        "running": is_running(cluster),  # as `up` decides whether to leave it be
        "dir": str(cluster.dir), "procs": procs, "slurm_conf": str(cluster.slurm_conf),
        "nodes": node_lines(info.stdout) if info.returncode == 0 else [],
    }


def export_lines(cluster: Cluster) -> str:
    return "".join(f"export {k}={v}\n" for k, v in cluster.exports().items())
