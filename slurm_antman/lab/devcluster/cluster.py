"""A real Slurm cluster on loopback: one slurmctld and several ``slurmd -N`` on this host.

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
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional
from pathlib import Path

import yaml

import slurm_antman
from slurm_antman import agent_bundle, site_settings
from slurm_antman import config as config_mod
from slurm_antman.errors import AntmanError
from slurm_antman.render import RenderOptions, write_all
from slurm_antman.slurm import version as slurm_version

from .dirs import DEFAULT_DIR

# The source checkout (the SPANK sources, etc/): the directory that holds the slurm_antman package.
REPO = Path(slurm_antman.__file__).resolve().parents[1]
DEFAULT_PORT_BASE = 17817
MUNGED = "/usr/sbin/munged"


class DevclusterError(AntmanError):
    pass


# The cluster's ordinary user: tests and `antman devcluster up`'s users submit as it, as at a site
# where nobody submits as root.
DEV_USER = "antman-dev"


def let_users_through(path: Path) -> None:
    """o+x on ``path`` and the directories above it up to /tmp (or /): the cluster's ordinary user must
    reach its slurm.conf, the emulated GPUs and the sidecar sockets under a cluster directory that may
    sit in a private temporary directory (pytest makes its own 0700; it puts the mode back on its next run)."""
    for p in [path, *path.parents]:
        if p == Path("/tmp") or p == p.parent:
            break
        try:
            p.chmod(p.stat().st_mode | 0o055)
        except OSError:
            break


def ensure_user(name: str = DEV_USER) -> tuple[int, int]:
    """(uid, gid) of the devcluster's unprivileged user, made on first use (a home directory of its
    own: PyTorch and pip write caches there)."""
    import pwd

    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        r = subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", "--user-group",
                            "--comment", "slurm-antman devcluster user", name], capture_output=True, text=True)
        if r.returncode not in (0, 9):  # 9: made meanwhile by another run
            raise DevclusterError(f"cannot create the devcluster user {name}: {r.stderr.strip()}")
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


@dataclass
class Proc:
    name: str
    pid: int
    exe: str

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A recycled PID belongs to some other program: treat ours as gone, and never signal it.
        try:
            return os.readlink(f"/proc/{self.pid}/exe") == os.path.realpath(self.exe)
        except OSError:
            return False


HOSTS_SUBNET = "10.231.0"  # inside the cluster's own network namespaces only: nothing else sees it
NETNS_DIR = Path("/run/netns")


@dataclass
class Hosts:
    """Every node a host of its own: its slurmd and sidecar in a network namespace with one interface
    and one address; slurmctld, slurmdbd, MariaDB and the coordinator in the controller's namespace,
    which holds the bridge that joins them. Every message between a node and the controller crosses a
    real interface, to an address only the cluster's own namespaces have. (The file system, munge's
    socket and the UTS name are shared: what a site shares through its configuration management.)"""

    prefix: str
    nodes: list[str]

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return f"{HOSTS_SUBNET}.1" if host == "ctl" else f"{HOSTS_SUBNET}.{11 + self.nodes.index(host)}"

    def enter(self, host: str) -> list[str]:
        # nsenter switches the network namespace only; `ip netns exec` would also remount /sys and hide
        # the cgroup hierarchies slurmd's task/cgroup needs.
        return ["nsenter", f"--net={NETNS_DIR / self.ns(host)}", "--"]

    def to_json(self) -> dict:
        return {"prefix": self.prefix, "nodes": self.nodes}

    @classmethod
    def from_json(cls, data: dict) -> "Hosts":
        return cls(str(data["prefix"]), list(data["nodes"]))

    def create(self) -> None:
        self.remove()  # what a killed run left behind
        ctl = self.ns("ctl")
        _ip("netns", "add", ctl)
        _ip_in(ctl, "link", "set", "lo", "up")
        _ip_in(ctl, "link", "add", "br0", "type", "bridge")
        _ip_in(ctl, "addr", "add", f"{self.addr('ctl')}/24", "dev", "br0")
        _ip_in(ctl, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            ns = self.ns(node)
            _ip("netns", "add", ns)
            _ip_in(ns, "link", "set", "lo", "up")
            # Both ends are made inside the cluster's namespaces: nothing appears in the host's own.
            _ip_in(ctl, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip_in(ctl, "link", "set", f"v{i}", "master", "br0", "up")
            _ip_in(ns, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            _ip_in(ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        for host in ["ctl", *self.nodes]:
            if (NETNS_DIR / self.ns(host)).exists():
                subprocess.run(["ip", "netns", "del", self.ns(host)], capture_output=True)

    def link(self, node: str, up: bool) -> None:
        """Connect or cut ``node``'s cable (its port on the controller's bridge): a network failure."""
        _ip_in(self.ns("ctl"), "link", "set", f"v{self.nodes.index(node)}", "up" if up else "down")


def _ip(*args: str, enter: Optional[list[str]] = None) -> None:
    r = subprocess.run([*(enter or []), "ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise DevclusterError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


def _ip_in(ns: str, *args: str) -> None:
    """``ip`` inside network namespace ``ns``. Not ``ip -n``: like ``ip netns exec`` it remounts /sys,
    which fails where / is no mount point (make test-slurm24's chroot)."""
    _ip(*args, enter=["nsenter", f"--net={NETNS_DIR / ns}", "--"])


@dataclass
class Cluster:
    dir: Path
    nodes: list[str]
    gpus: int
    port_base: int
    plain: bool
    procs: list[Proc] = field(default_factory=list)
    accounting: bool = False  # slurmdbd and MariaDB run beside slurmctld (devcluster.accounting)
    user: str = DEV_USER  # the unprivileged user jobs are submitted as
    hosts: Optional["Hosts"] = None  # each node a network namespace of its own (``up(hosts=True)``)
    installed: Optional[str] = None  # PREFIX of a `make install` the daemons and hooks run from (``up(installed=)``)

    @property
    def slurm_conf(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    @property
    def config_path(self) -> Path:
        return self.dir / "antman.yaml"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.exports())
        return env

    def exports(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.slurm_conf), "ANTMAN_CONFIG": str(self.config_path)}

    def run(self, args: list[str], check: bool = False, timeout: float = 60, env: dict | None = None,
            as_user: tuple[int, int] | None = None, host: str = "ctl", **kw) -> subprocess.CompletedProcess:
        """A command on the cluster: Slurm's clients reach slurmctld from the controller's host (its
        network namespace, when the nodes are hosts of their own). ``as_user``: (uid, gid) to run it as."""
        argv = list(args)
        if as_user is not None:
            # setpriv, not subprocess's user=: nsenter must still be root when it runs.
            argv = ["setpriv", f"--reuid={as_user[0]}", f"--regid={as_user[1]}", "--clear-groups", "--", *argv]
        if self.hosts is not None:
            argv = self.hosts.enter(host) + argv
        return subprocess.run(argv, env=env or self.env, capture_output=True, text=True, check=check,
                              timeout=timeout, **kw)

    def to_json(self) -> dict:
        return {
            "dir": str(self.dir), "nodes": self.nodes, "gpus": self.gpus, "port_base": self.port_base,
            "plain": self.plain, "slurm_conf": str(self.slurm_conf),
            "procs": [p.__dict__ for p in self.procs], "accounting": self.accounting, "user": self.user,
            "hosts": self.hosts.to_json() if self.hosts else None, "installed": self.installed,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Cluster":
        return cls(Path(data["dir"]), data["nodes"], data["gpus"], data["port_base"], data["plain"],
                   [Proc(**p) for p in data["procs"]], bool(data.get("accounting", False)),
                   str(data.get("user", DEV_USER)), Hosts.from_json(data["hosts"]) if data.get("hosts") else None,
                   data.get("installed"))


def _state_file(d: Path) -> Path:
    return d / "cluster.json"


def load(d: Path = DEFAULT_DIR) -> Cluster | None:
    f = _state_file(Path(d))
    if not f.exists():
        return None
    return Cluster.from_json(json.loads(f.read_text()))


def _shape_file(d: Path) -> Path:
    return d / "up.json"


def is_running(cluster: Cluster) -> bool:
    """Every daemon ``up`` started still runs. munged may be the host's own (then not ours to watch)."""
    return all(p.alive() for p in cluster.procs if p.name != "munged")


def running(d: Path = DEFAULT_DIR) -> Cluster | None:
    """The cluster running in ``d``, or None."""
    cluster = load(Path(d).resolve())
    return cluster if cluster is not None and is_running(cluster) else None


def shape_differences(d: Path, asked: dict) -> list[str]:
    """What ``asked`` (``up``'s arguments that make a cluster what it is) sets otherwise than the cluster
    started in ``d`` was asked for, as 'name: running X, asked Y'. A cluster started before ``up`` wrote
    its arguments down has none."""
    try:
        had = json.loads(_shape_file(Path(d)).read_text())
    except (OSError, ValueError):
        return []
    want = json.loads(json.dumps(asked, default=str))  # as stored: tuples become lists, paths strings
    return [f"{k}: running {had[k]!r}, asked {v!r}" for k, v in want.items() if k in had and had[k] != v]


def _which(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
    if not path:
        raise DevclusterError(f"{name} not found: install slurm-wlm and munge (make deps)")
    return path


COORDINATOR_PORT_OFFSET = 90


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``; mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_dir(port_base: int) -> Path:
    """The cluster's sockets live under /run, as a site's do, and short: a Unix socket path holds at
    most 107 bytes, and slurmstepd's (SPOOL/NODE_JOBID.STEP) or the sidecar's (DIR/NODE/jobs/JOBID/
    agent.sock) under a deep cluster directory (a test's temporary one) with 7-digit job ids
    (``first_job_id``) do not fit."""
    return Path("/run") / f"antman-dev-{port_base}"


def sidecar_socket_dir(port_base: int) -> Path:
    return run_dir(port_base) / "sidecar"


def slurmd_spool_dir(port_base: int, node: str) -> Path:
    return run_dir(port_base) / f"slurmd-{node}"


def dev_config(d: Path, nodes: int, gpus: int, cpus: int, antman_command: str,
               port_base: int = DEFAULT_PORT_BASE, overrides: dict | None = None) -> dict:
    """The antman.yaml of a devcluster: same model as a site's, paths under the cluster directory.
    ``overrides`` (same shape as antman.yaml) is merged on top, e.g. ``{"grace_time_s": 5}``; a
    mapping under ``nodes`` applies to the one node group (``{"nodes": {"gpu_memory_mb": 2048}}``)."""
    raw = _base_dev_config(d, nodes, gpus, cpus, antman_command, port_base)
    if overrides:
        node_over = overrides.get("nodes")
        if isinstance(node_over, dict):
            overrides = {**overrides, "nodes": [_merge(raw["nodes"][0], node_over)]}
        raw = _merge(raw, overrides)
    return raw


def _base_dev_config(d: Path, nodes: int, gpus: int, cpus: int, antman_command: str, port_base: int) -> dict:
    return {
        "cluster_name": "antmandev",
        "default_class": "none",
        "grace_time_s": 10,
        "state_dir": str(d / "antman-state"),
        "plugin_path": str(d / "lib" / "antman_spank.so"),
        "antman_command": antman_command,
        # Built at up() from this checkout, so every job (in this venv or its own) loads the agent
        # the way a site's jobs do: from the bundle the SPANK plugin puts on PYTHONPATH.
        "agent_path": str(d / "lib" / "agent"),
        "sidecar": {"socket_dir": str(sidecar_socket_dir(port_base)), "telemetry": "emulated"},
        "nodes": [{
            "name": f"node[1-{nodes}]" if nodes > 1 else "node1",
            "gpus": gpus, "cpus": cpus, "memory_mb": 4000, "gpu_memory_mb": 16384,
            "gpu_files": str(d / "dev" / (f"nvidia[0-{gpus - 1}]" if gpus > 1 else "nvidia0")),
        }],
        "tenants": [{"account": "research", "guaranteed_gpus": gpus}, {"account": "product", "guaranteed_gpus": gpus}],
        "coordinator": {
            "endpoint": f"tcp://127.0.0.1:{port_base + COORDINATOR_PORT_OFFSET}",
            "key_dir": str(d / "keys"),
            "report_interval_s": 1.0,
            "audit_log": str(d / "log" / "coordinator-audit.jsonl"),
            "quota_file": str(d / "etc" / "antman_quota.lua"),
            "cycle_s": 1.0,
            "accounting_refresh_s": 5.0,  # a change made with sacctmgr shows within seconds, for development
        },
    }


CGROUP_CONF = (
    "# Generated by `antman devcluster up`: jobs confined to the devices they hold, as at a GPU site.\n"
    "CgroupPlugin=cgroup/v1\n"
    "ConstrainDevices=yes\n"
    # Cores and memory are not what the devcluster tests, and a 2-core host over-claims both.
    "ConstrainCores=no\n"
    "ConstrainRAMSpace=no\n"
    "ConstrainSwapSpace=no\n"
)


def first_job_id(port_base: int) -> int:
    """Job ids of clusters on one host must not meet: Slurm's cgroup v1 tree is shared by every
    slurmd of the host (``/sys/fs/cgroup/devices/slurm_NODE/uid_U/job_J``), and two clusters both
    naming a node node1 would put their jobs J in one cgroup. Each port base gets its own range."""
    return (port_base % 10000) * 1000 + 1


def _base_slurm_conf(d: Path, port_base: int, with_antman: bool, accounting: list[str] | None = None,
                     version: tuple[int, int, int] = (22, 5, 0), cgroups: bool = True,
                     ctl_addr: Optional[str] = None) -> str:
    """``accounting``: the slurm.conf lines that point slurmctld at the devcluster's slurmdbd;
    ``version``: the installed Slurm's (what differs by version comes from slurm_antman.slurm.version);
    ``cgroups``: confine jobs to their devices (task/cgroup, ConstrainDevices=yes), as GPU sites do."""
    lines = [
        "# Generated by `antman devcluster up`: a real Slurm cluster on loopback for development.",
        "ClusterName=antmandev",
        # "localhost" is the name slurmctld takes as its own; on a cluster of hosts the address in
        # brackets is where the nodes and clients reach it.
        f"SlurmctldHost=localhost({ctl_addr})" if ctl_addr else "SlurmctldHost=localhost",
        f"SlurmctldPort={port_base}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        slurm_version.cred_type_line(version),
        f"StateSaveLocation={d}/state/ctld",
        f"SlurmdSpoolDir={slurmd_spool_dir(port_base, '%n')}",
        f"SlurmctldPidFile={d}/run/slurmctld.pid",
        f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # Several slurmd on a 2-core host claim more CPUs than exist; fine for a functional cluster.
        "SlurmdParameters=config_overrides",
        *(["ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup"] if cgroups
          else ["ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none"]),
        f"FirstJobId={first_job_id(port_base)}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        *(accounting or ["AccountingStorageType=accounting_storage/none"]),
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=600",
        "MessageTimeout=20",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        f"PlugStackConfig={d}/etc/plugstack.conf",
        # The site's own values of keys slurm-antman needs more of: up() merges its needs into them
        # (site_settings), so every cluster shows a merge that keeps what the site had.
        "GresTypes=gpu",
        "SlurmctldParameters=enable_configless",
        f"Include {d}/etc/antman.slurm.conf",
    ]
    return "\n".join(lines) + "\n"


def build_spank(dest: Path) -> Path:
    """Build the SPANK plugin from the source tree (so the devcluster always runs the current code)."""
    src = REPO / "spank"
    if not (src / "Makefile").exists():
        raise DevclusterError(f"{src}/Makefile missing: the SPANK plugin sources are not in this checkout")
    r = subprocess.run(["make", "-s", "-C", str(src)], capture_output=True, text=True)
    if r.returncode:
        raise DevclusterError(f"building the SPANK plugin failed:\n{r.stdout}{r.stderr}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "antman_spank.so", dest)
    return dest


NVIDIA_MAJOR = 195  # the character-device major of /dev/nvidiaN (NVIDIA's driver; minor N is GPU N)


def make_gpu_devices(dev_dir: Path, gpus: int) -> list[Path]:
    """Emulated GPUs as character devices with NVIDIA's own numbers, ``c 195 N``: Slurm binds them as
    it would real ones, and a devices cgroup tells them apart. No driver serves major 195 here, so
    ``open()`` of a GPU the cgroup allows fails with ENXIO, of one it denies with EPERM: a job can
    tell "Slurm (or slurm-antman) let me use this GPU" from "it did not". An older node of another
    number (``c 1 3``, /dev/null's, from before) is replaced."""
    dev_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(gpus):
        dev = dev_dir / f"nvidia{i}"
        want = os.makedev(NVIDIA_MAJOR, i)
        try:
            st = os.lstat(dev)
            if not (stat.S_ISCHR(st.st_mode) and st.st_rdev == want):
                dev.unlink()
        except FileNotFoundError:
            pass
        if not dev.exists():
            os.mknod(dev, 0o666 | stat.S_IFCHR, want)
            os.chmod(dev, 0o666)  # the umask must not keep an ordinary user's job from trying it
        out.append(dev)
    return out


def _munge_works() -> bool:
    return subprocess.run(["munge", "-n"], capture_output=True).returncode == 0


def _munged_pids_here() -> list[int]:
    """munged processes whose root directory is ours. A munged in a chroot (make test-slurm24's
    trixie one) shares our PID namespace but serves another socket and key: it is not ours to
    wait for."""
    here = os.stat("/")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "munged":
                continue
            root = os.stat(entry / "root")
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        if (root.st_dev, root.st_ino) == (here.st_dev, here.st_ino):
            pids.append(int(entry.name))
    return pids


def _ensure_munged(procs: list[Proc]) -> None:
    if _munge_works():
        return
    # A munged that is still exiting (a cluster stopped a moment ago) is seen by pgrep but serves
    # nothing: wait for it to go, then start ours.
    for _ in range(100):
        if not _munged_pids_here():
            break
        time.sleep(0.1)
    else:
        raise DevclusterError("a munged process runs but munge -n fails: check /var/log/munge/munged.log")
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    r = subprocess.run(["runuser", "-u", "munge", "--", MUNGED], capture_output=True, text=True)
    if r.returncode:
        raise DevclusterError(f"munged failed to start: {r.stderr.strip()}")
    pidfile = Path("/run/munge/munged.pid")
    for _ in range(50):
        if pidfile.exists() and pidfile.read_text().strip():
            procs.append(Proc("munged", int(pidfile.read_text().strip()), os.path.realpath(MUNGED)))
            return
        time.sleep(0.1)
    raise DevclusterError("munged started but wrote no pid file")


def _spawn(name: str, argv: list[str], env: dict, log: Path, enter: Optional[list[str]] = None) -> Proc:
    """Start a daemon; ``enter``: the command that puts it on its host (nsenter into a network
    namespace), which execs the daemon in the same process."""
    exe = os.path.realpath(argv[0])
    with open(log, "ab") as out:
        p = subprocess.Popen([*(enter or []), *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    if enter:
        # Until nsenter has exec'd it, the PID is nsenter's: Proc.alive() would read it as gone.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if os.readlink(f"/proc/{p.pid}/exe") == exe:
                    break
            except OSError:
                pass
            time.sleep(0.01)
    return Proc(name, p.pid, exe)


def _enter(cluster: "Cluster", host: str) -> Optional[list[str]]:
    return cluster.hosts.enter(host) if cluster.hosts is not None else None


def up(d: Path = DEFAULT_DIR, nodes: int = 2, gpus: int = 4, cpus: int = 4, port_base: int = DEFAULT_PORT_BASE,
       plain: bool = False, timeout: float = 90, sidecars: bool = True, extra_slurm_conf: str = "",
       extra_etc_files: dict[str, str] | None = None, coordinator: bool = True,
       overrides: dict | None = None, accounting: bool = True, cgroups: bool = True,
       hosts: bool = False, installed: Optional[Path] = None,
       require: Optional[Iterable[str]] = None, site_scripts: bool = False) -> Cluster:
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
    cli_filter.lua (site rules plus the one line calling slurm-antman's modules) instead of the plain ones."""
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
    make_gpu_devices(d / "dev", gpus)

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
    (d / "antman.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = config_mod.load(d / "antman.yaml")
    # Every node of every node group (a test may give several, e.g. of two GPU types).
    cluster = Cluster(d, [h for g in cfg.nodes for h in g.hosts], gpus, port_base, plain, accounting=accounting,
                      hosts=the_hosts if hosts else None, installed=str(installed) if installed else None)
    if cluster.hosts is not None:
        node_params = {h: f"Port={port_base + 1 + i} NodeAddr={cluster.hosts.addr(h)} NodeHostname={h}"
                       for i, h in enumerate(cluster.nodes)}
    else:
        node_params = {h: f"Port={port_base + 1 + i} NodeHostname=localhost" for i, h in enumerate(cluster.nodes)}
    opts = RenderOptions(config_path=str(d / "antman.yaml"), hook_dir=str(d / "etc"),
                         slurm_conf=str(cluster.slurm_conf), with_antman=not plain, node_params=node_params)
    write_all(cfg, d / "etc", opts)
    acct_lines = None
    if accounting:
        acct.prepare(d, port_base)
        acct_lines = acct.slurm_conf_lines(port_base, (cfg.slurm.gpu_gres,),
                                           cluster.hosts.addr("ctl") if cluster.hosts is not None else "localhost")
    ctl_addr = cluster.hosts.addr("ctl") if cluster.hosts is not None else None
    # The devcluster plays a site with slurm.conf settings of its own, and merges what slurm-antman needs
    # into them as docs/admin.md tells an admin to (antman config merge-slurm-conf): never overwritten.
    site_conf = _base_slurm_conf(d, port_base, not plain, acct_lines, version, cgroups, ctl_addr)
    merged = site_settings.merge_text(site_conf, site_settings.needs(cfg, str(d / "etc"), with_antman=not plain),
                                      many_prologs=slurm_version.many_prolog_lines(version))
    if merged.conflicts:
        raise DevclusterError("the devcluster's slurm.conf conflicts with what slurm-antman needs: "
                              + "; ".join(merged.conflicts))
    (d / "etc" / "slurm.conf").write_text(merged.text + extra_slurm_conf)
    cgroup_conf = d / "etc" / "cgroup.conf"
    if cgroups:
        cgroup_conf.write_text(CGROUP_CONF)
    else:
        cgroup_conf.unlink(missing_ok=True)
    for h in cluster.nodes:  # 24.11's slurmd does not make its spool directory (22.05's does)
        slurmd_spool_dir(port_base, h).mkdir(parents=True, exist_ok=True)
    for name, text in (extra_etc_files or {}).items():
        (d / "etc" / name).write_text(text)
    if plain:
        (d / "etc" / "plugstack.conf").write_text("# plain Slurm: no SPANK plugins\n")
    else:
        (d / "etc" / "plugstack.conf").write_text(f"include {d}/etc/plugstack.conf.d/*.conf\n")
        # The Lua scripts as a site copies them beside slurm.conf: from the install, or this checkout.
        lua = Path(installed) / "share" / "slurm-antman" / "lua" if installed else REPO / "etc"
        # Every one of them: the scripts and the modules they load (an older install has no modules).
        for script in sorted(lua.glob("*.lua")):
            shutil.copy2(script, d / "etc" / script.name)
        if site_scripts:  # a site's own scripts, each with the one line that calls slurm-antman's module
            for name in ("job_submit.lua", "cli_filter.lua"):
                shutil.copy2(REPO / "etc" / "examples" / name, d / "etc" / name)
        if not installed:  # an install brings its own plugin and agent bundle
            build_spank(d / "lib" / "antman_spank.so")
            if cfg.agent_path:
                agent_bundle.build(Path(cfg.agent_path))

    env = _daemon_env(cluster)
    _ensure_munged(cluster.procs)
    try:
        _record(cluster, None)
        if cluster.hosts is not None:
            cluster.hosts.create()
        if accounting:
            _record(cluster, acct.start_mariadb(cluster, env))
            _record(cluster, acct.start_slurmdbd(cluster, env))
        _record(cluster, start_slurmctld(cluster, env, clear_state=True))
        for h in cluster.nodes:
            _record(cluster, _spawn(f"slurmd:{h}", [_which("slurmd"), "-D", "-N", h], env,
                                    d / "log" / f"slurmd-{h}.out", _enter(cluster, h)))
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
    argv = [_which("slurmctld"), "-D", *(["-c"] if clear_state else []), "-i"]
    return _spawn("slurmctld", argv, env, cluster.dir / "log" / "slurmctld.out", _enter(cluster, "ctl"))


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


def _proc_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children = _proc_children()
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


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


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


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
