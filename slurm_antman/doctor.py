"""``antman doctor``: checks one node or the controller host and names what is missing or wrong.

Each check gives ok, warn or fail, a one-line reason, and for anything not ok a hint saying what to
do. Checks that depend on an earlier one (Slurm reachable, config valid) are skipped with a reason
rather than failing twice for one cause. Exit status: 1 when any check failed, else 0.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shlex
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from . import config as cfgmod
from . import site_settings
from .coordinator import tenants
from .slurm import SlurmBackend, SlurmError, SlurmOutputError
from .slurm import version as slurm_version

SKEW_WARN_S = 2.0
SKEW_FAIL_S = 60.0  # munge credentials carry a timestamp; large skew makes slurmd reject them
COMMAND_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    reason: str
    hint: str = ""


def ok(name: str, reason: str) -> Check:
    return Check(name, "ok", reason)


def warn(name: str, reason: str, hint: str) -> Check:
    return Check(name, "warn", reason, hint)


def fail(name: str, reason: str, hint: str) -> Check:
    return Check(name, "fail", reason, hint)


def skip(name: str, reason: str) -> Check:
    return Check(name, "skip", reason)


def _slurm() -> SlurmBackend:
    from .slurm.cli_backend import CliBackend

    return CliBackend(timeout=COMMAND_TIMEOUT_S)


def _why(e: SlurmError) -> str:
    """The command's own last word (what an admin would see running it), else the adapter's message."""
    lines = [ln.strip() for ln in e.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else e.message


def _read_config() -> dict[str, str]:
    return _slurm().config()


def slurm_config(read: Callable[[], dict[str, str]] = _read_config) -> tuple[Optional[dict[str, str]], Check]:
    """The running Slurm's effective configuration (``scontrol show config``, through the Slurm adapter):
    what slurmctld runs with, whatever files it came from."""
    try:
        conf = read()
    except SlurmError as e:
        return None, fail("slurm", f"scontrol show config failed: {e.message}",
                          "start slurmctld, or set SLURM_CONF to the slurm.conf this host uses")
    return conf, ok("slurm", f"slurmctld answers (Slurm {conf.get('SLURM_VERSION', '?')}, "
                             f"slurm.conf {conf.get('SLURM_CONF', '?')})")


def check_config(path: str) -> tuple[Optional[cfgmod.AntmanConfig], Check]:
    try:
        cfg = cfgmod.load(path)
    except cfgmod.ConfigError as e:
        line = f"line {e.lines[0]}: " if e.lines and e.lines[0] is not None else ""
        first = f"{line}{e.problems[0][0]}: {e.problems[0][1]}" if e.problems else str(e)
        more = f" (+{len(e.problems) - 1} more)" if len(e.problems) > 1 else ""
        return None, fail("config", f"{path}: {first}{more}",
                          f"fix the file; `antman config check {path}` lists every problem")
    return cfg, ok("config", f"{path} is valid ({sum(len(g.hosts) for g in cfg.nodes)} nodes, "
                             f"{len(cfg.tenants)} tenants)")


def check_agent_bundle(cfg: cfgmod.AntmanConfig, node: str) -> Check:
    """The agent bundle a GPU node's jobs load the agent from (agent_path): there, whole, readable
    by every job's user, and of this release."""
    from . import __version__, agent_bundle

    name = "agent_bundle"
    if not cfg.agent_path:
        return ok(name, "agent_path is null: only Pythons with slurm-antman installed load the agent")
    if node not in {h for g in cfg.nodes for h in g.hosts}:
        return skip(name, f"{node} is not a GPU node of antman.yaml: only GPU nodes' jobs read the bundle")
    try:
        marker = agent_bundle.read(Path(cfg.agent_path))
    except agent_bundle.BundleError as e:
        return fail(name, str(e), f"make install on this node (or antman agent-bundle --out {cfg.agent_path}); "
                                  "without it a job's own Python (a venv with only torch) runs without the agent")
    loader = Path(cfg.agent_path) / "sitecustomize.py"
    if not (os.stat(cfg.agent_path).st_mode & 0o005 == 0o005 and loader.is_file()
            and loader.stat().st_mode & 0o004):
        return fail(name, f"{cfg.agent_path} is not readable by every user (or has no sitecustomize.py)",
                    f"antman agent-bundle --out {cfg.agent_path} builds it world-readable")
    builds = ", ".join(marker.get("zmq_builds", [])) or "none"
    if marker.get("version") != __version__:
        return warn(name, f"{cfg.agent_path} is from slurm-antman {marker.get('version')}, this antman is "
                          f"{__version__}", f"antman agent-bundle --out {cfg.agent_path} (make install does it)")
    return ok(name, f"{cfg.agent_path}: the agent for jobs' own Pythons, with pyzmq for {builds}")


def check_plugin_file(cfg: cfgmod.AntmanConfig) -> Check:
    p = Path(cfg.plugin_path)
    if not p.is_file():
        return fail("spank_plugin", f"plugin_path {cfg.plugin_path} does not exist",
                    "build and install it: make -C spank install (or point plugin_path at the installed .so)")
    return ok("spank_plugin", f"{cfg.plugin_path} present")


def _plugstack_lines(path: str, depth: int = 0) -> list[tuple[str, str]]:
    """(file, line) of every plugin line in plugstack.conf and the files it includes."""
    if depth > 8:
        return []
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    out = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        if words[0] == "include" and len(words) > 1:
            pattern = words[1] if words[1].startswith("/") else str(Path(path).parent / words[1])
            for inc in sorted(glob.glob(pattern)):
                out += _plugstack_lines(inc, depth + 1)
        else:
            out.append((path, line))
    return out


def check_plugstack(cfg: cfgmod.AntmanConfig, sconf: dict[str, str]) -> Check:
    stack = sconf.get("PlugStackConfig") or str(Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
                                                 / "plugstack.conf")
    if not Path(stack).is_file():
        return fail("plugstack", f"PlugStackConfig {stack} does not exist",
                    f"create it with the line: include {Path(stack).parent}/plugstack.conf.d/*.conf")
    for where, line in _plugstack_lines(stack):
        words = line.split()
        if len(words) >= 2 and words[0] in ("required", "optional") and words[1] == cfg.plugin_path:
            return ok("plugstack", f"{where} loads {cfg.plugin_path} ({words[0]})")
    return fail("plugstack", f"{stack} (with its includes) does not list {cfg.plugin_path}",
                f"`antman config render` writes plugstack.conf.d/antman.conf; add `include "
                f"{Path(stack).parent}/plugstack.conf.d/*.conf` to {stack}")


def check_sbatch_option() -> Check:
    try:
        text = _slurm().sbatch_help()
    except SlurmError as e:
        return fail("sbatch_option", f"sbatch --help failed: {_why(e)}",
                    "install the Slurm client commands (slurm-client) on this host")
    if "--antman" not in text:
        return fail("sbatch_option", "sbatch --help does not show --antman: the SPANK plugin is not loaded",
                    "check the plugstack line and that the .so loads (slurmctld/slurmd logs name spank errors)")
    return ok("sbatch_option", "sbatch --help shows --antman")


def plugin_slurm_version(path: str) -> tuple[int, int, int]:
    """The Slurm version the plugin was compiled against (SPANK_PLUGIN's ``plugin_version``)."""
    # RTLD_LAZY: the plugin's calls into libslurm stay unresolved, which is fine for reading one integer.
    lib = ctypes.CDLL(os.path.abspath(path), mode=os.RTLD_LAZY | getattr(os, "RTLD_LOCAL", 0))
    v = ctypes.c_uint32.in_dll(lib, "plugin_version").value
    return v >> 16, (v >> 8) & 0xFF, v & 0xFF


def check_versions(cfg: cfgmod.AntmanConfig, sconf: dict[str, str]) -> Check:
    running = sconf.get("SLURM_VERSION", "")
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", running)
    if not m:
        return warn("slurm_version", f"cannot read Slurm's version ({running!r})", "run scontrol show config")
    have = tuple(int(x) for x in m.groups())
    try:
        slurm_version.check_supported(have)
    except slurm_version.UnsupportedSlurm as e:
        return fail("slurm_version", e.message, "run slurm-antman on a supported Slurm")
    try:
        built = plugin_slurm_version(cfg.plugin_path)
    except OSError as e:
        return fail("slurm_version", f"cannot load {cfg.plugin_path}: {e}",
                    "rebuild it on this host: make -C spank install")
    except ValueError:
        return fail("slurm_version", f"{cfg.plugin_path} has no plugin_version: not a SPANK plugin",
                    "plugin_path must name antman_spank.so")
    built_s = f"{built[0]}.{built[1]:02d}.{built[2]}"
    if built[:2] != have[:2]:
        return fail("slurm_version", f"plugin built for Slurm {built_s}, Slurm here is {running}",
                    "rebuild the plugin against this Slurm's headers: make -C spank clean install")
    if not slurm_version.is_tested(have):
        return warn("slurm_version", f"Slurm {running} is supported but untested; slurm-antman is tested on "
                    + " and ".join(slurm_version.fmt(v) for v in slurm_version.TESTED),
                    "run the test suite against this version")
    return ok("slurm_version", f"plugin built for {built_s}, Slurm {running}")


JOB_SUBMIT_MODULE = "antman_job_submit.lua"
JOB_SUBMIT_FILES = ("job_submit.lua", JOB_SUBMIT_MODULE, "antman_settings_loader.lua", "antman_settings.lua")
CHAIN_LINE = ('dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. '
              '"antman_job_submit.lua").chain()')


def check_job_submit(sconf: dict[str, str]) -> Check:
    """The Lua files next to slurm.conf, and the site's job_submit.lua calling the module (whether Slurm
    runs job_submit/lua at all is the slurm_conf check's)."""
    etc = Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
    missing = [n for n in JOB_SUBMIT_FILES if not (etc / n).is_file()]
    if missing:
        return fail("job_submit", f"missing next to slurm.conf in {etc}: {', '.join(missing)}",
                    "copy etc/antman_job_submit.lua and etc/antman_settings_loader.lua there (and etc/job_submit.lua "
                    "where the site has none), and run `antman config render` for antman_settings.lua")
    try:
        text = (etc / "job_submit.lua").read_text(errors="replace")
    except OSError as e:
        return fail("job_submit", f"cannot read {etc / 'job_submit.lua'}: {e.strerror}", "check its permissions")
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
    if JOB_SUBMIT_MODULE not in code:
        return fail("job_submit", f"{etc / 'job_submit.lua'} does not load {JOB_SUBMIT_MODULE}: jobs are not "
                                  "classified",
                    f"add this line to it (anywhere at its top level): {CHAIN_LINE}")
    return ok("job_submit", f"job_submit.lua in {etc} loads {JOB_SUBMIT_MODULE}; settings and loader beside it")


def check_slurm_conf(cfg: cfgmod.AntmanConfig, sconf: dict[str, str]) -> list[Check]:
    """The site-wide keys slurm-antman needs, judged on the running Slurm's values (by membership for the
    lists): one line per key that lacks something, naming what the site has and what is needed."""
    probs = site_settings.problems(site_settings.needs(cfg), sconf)
    hint = ("merge the needs into slurm.conf (antman config merge-slurm-conf, or by hand from the rendered "
            "slurm.conf.needed), then restart slurmctld and slurmd")
    if not probs:
        return [ok("slurm_conf", "the site-wide settings slurm-antman needs are in force (GresTypes, preemption, "
                                 "plugins, Prolog/Epilog" + (", AccountingStorageTRES" if sconf.get(
                                     "AccountingStorageType") == tenants.SLURMDBD else "") + ")")]
    return [fail("slurm_conf", p.text, hint) for p in probs]


QUOTA_FILE_NAME = "antman_quota.lua"  # the one name job_submit.lua reads, from its own directory


def check_quota_file(cfg: cfgmod.AntmanConfig, sconf: Optional[dict[str, str]]) -> Check:
    """Without coordinator.quota_file the coordinator writes no quota use, and job_submit.lua resolves
    every ``--antman=auto`` job to auto_class (guaranteed by default) whatever the tenant holds."""
    path = cfg.coordinator.quota_file
    example = "/etc/slurm/" + QUOTA_FILE_NAME
    if sconf is not None:
        example = str(Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent / QUOTA_FILE_NAME)
    if not path:
        if cfg.tenants or cfg.coordinator.quota_source == "accounting":
            why = (f"{len(cfg.tenants)} tenant(s) in antman.yaml" if cfg.tenants
                   else "coordinator.quota_source is accounting")
            return fail("quota_file", f"{why} but coordinator.quota_file is unset: --antman=auto ignores "
                                      "tenant quotas and every auto job gets auto_class",
                        f"add `quota_file: {example}` under coordinator: in antman.yaml (next to job_submit.lua, "
                        "writable by the coordinator) and systemctl reload antman-coordinator")
        if cfg.coordinator.quota_source == "auto" and (sconf or {}).get("AccountingStorageType") == tenants.SLURMDBD:
            return warn("quota_file", "coordinator.quota_file is unset: if accounts have GrpTRES GPU limits in "
                                      "Slurm accounting, --antman=auto ignores them",
                        f"add `quota_file: {example}` under coordinator: in antman.yaml")
        return ok("quota_file", "no tenants in antman.yaml and coordinator.quota_file unset: auto jobs get "
                                "the site's auto_class")
    if Path(path).name != QUOTA_FILE_NAME:
        return fail("quota_file", f"coordinator.quota_file is {path}; job_submit.lua reads only {QUOTA_FILE_NAME}",
                    f"set coordinator.quota_file: {Path(path).parent / QUOTA_FILE_NAME} (in the directory "
                    "of job_submit.lua)")
    if sconf is not None and os.path.realpath(Path(path).parent) != os.path.realpath(Path(example).parent):
        # A warning: on a node in configless mode slurm.conf lives elsewhere than on the controller.
        return warn("quota_file", f"coordinator.quota_file {path} is not next to slurm.conf "
                                  f"({Path(example).parent}), where slurmctld loads job_submit.lua from",
                    f"on the controller set coordinator.quota_file: {example}")
    return ok("quota_file", f"the coordinator writes tenant quota use to {path}")


def check_hooks(sconf: dict[str, str]) -> Check:
    """The programs Slurm runs as Prolog/Epilog are executable here (whether one of them runs antman's
    hook is the slurm_conf check's)."""
    problems = []
    for key in ("Prolog", "Epilog"):
        progs = site_settings._members(sconf.get(key))
        if not progs:
            problems.append(f"{key} is not set")
            continue
        base = Path(sconf.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
        for prog in progs:
            path = shlex.split(prog)[0] if prog.strip() else prog
            path = path if path.startswith("/") else str(base / path)
            found = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
            for f in found or [path]:
                if not os.access(f, os.X_OK):
                    problems.append(f"{key}={f} is not an executable file")
    if problems:
        return fail("prolog_epilog", "; ".join(problems),
                    "set Prolog=/Epilog= to the rendered antman-prolog/antman-epilog (slurm.conf.needed); the "
                    "hooks must be executable on every node")
    return ok("prolog_epilog", f"Prolog={sconf['Prolog']}, Epilog={sconf['Epilog']}")


def check_sidecar(cfg: cfgmod.AntmanConfig, node: str) -> Check:
    if node not in cfg.node_groups_by_host():
        return skip("sidecar", f"{node} is not a GPU node in antman.yaml (controller host?)")
    from .clients import sidecar_control as client

    sock = cfg.node_socket_dir(node)
    try:
        client.ping(sock, timeout_s=2.0)
    except client.SidecarUnreachable as e:
        return fail("sidecar", f"no sidecar answers on {sock}: {e}",
                    "systemctl start antman-sidecar (journalctl -u antman-sidecar says why it stopped)")
    return ok("sidecar", f"sidecar for {node} answers on {sock}")


def _endpoint_host_port(endpoint: str) -> tuple[str, str]:
    m = re.match(r"^tcp://\[?([^\]]*?)\]?:(\d+)$", endpoint)
    return (m.group(1), m.group(2)) if m else (endpoint, "")


def check_coordinator(cfg: cfgmod.AntmanConfig, node: str, timeout_s: float = 5.0) -> Check:
    """Whether this node's sidecar can report: a TCP connection to ``coordinator.endpoint`` and the
    CURVE handshake with this node's key, watched on a ZeroMQ socket monitor. Nothing is sent: a
    message in this node's name would route the coordinator's next messages for the node to this
    probe instead of its sidecar."""
    if node not in cfg.node_groups_by_host():
        return skip("coordinator_link", f"{node} is not a GPU node in antman.yaml: no sidecar reports from here")
    c = cfg.coordinator
    secret = c.secret_key_path(node)
    if c.key_dir is None or secret is None:
        return fail("coordinator_link", "coordinator.key_dir is not set: this node's sidecar reports to nobody",
                    "antman keys init --config antman.yaml on the coordinator's host, then copy the node keys")
    import zmq
    import zmq.utils.monitor as zmon

    from . import curve_keys

    try:
        server = curve_keys.load_server_public(c.key_dir)
        public, secret_key = curve_keys.load_keypair(secret)
    except curve_keys.KeysError as e:
        return fail("coordinator_link", f"no CURVE keys for node {node}: {e}",
                    f"copy this node's keys from the coordinator's host ({c.key_dir}) as `antman keys init` says")
    host, port = _endpoint_host_port(c.endpoint)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server, public, secret_key
    mon = sock.get_monitor_socket()
    connected = False
    outcome = None
    try:
        sock.connect(c.endpoint)
        deadline = time.monotonic() + timeout_s
        while outcome is None and time.monotonic() < deadline:
            if not mon.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            ev = zmon.recv_monitor_message(mon)["event"]
            if ev == zmq.EVENT_CONNECTED:
                connected = True
            elif ev == getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", -1):
                outcome = "ok"
            elif ev in (getattr(zmq, "EVENT_HANDSHAKE_FAILED_AUTH", -2),
                        getattr(zmq, "EVENT_HANDSHAKE_FAILED_PROTOCOL", -3),
                        getattr(zmq, "EVENT_HANDSHAKE_FAILED_NO_DETAIL", -4)):
                outcome = "refused"
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
    where = f"{host} port {port}" if port else c.endpoint
    if outcome == "ok":
        return ok("coordinator_link", f"reached the coordinator at {c.endpoint} and passed its CURVE handshake "
                  f"as node {node}")
    if outcome == "refused" or connected:
        return fail("coordinator_link", f"reached {c.endpoint}, but the CURVE handshake as node {node} failed "
                    f"{'(key refused)' if outcome else f'(no answer in {timeout_s:g} s)'}",
                    f"the coordinator admits the keys in {curve_keys.sidecars_dir(c.key_dir)}: this node's public "
                    "key must be there, and this node's copy of the server key current (antman keys init)")
    return fail("coordinator_link", f"cannot reach the coordinator at {c.endpoint}: no TCP connection in "
                f"{timeout_s:g} s",
                f"on the coordinator's host let this node in on TCP {where} (firewall), check that "
                "coordinator.endpoint names an address of that host this node can route to, and that the "
                "coordinator runs (systemctl status antman-coordinator)")


def check_nvml() -> Check:
    try:
        import pynvml
    except ImportError:
        return warn("nvml", "nvidia-ml-py (pynvml) is not installed", "pip install nvidia-ml-py on GPU nodes")
    try:
        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            drv = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return warn("nvml", f"NVML does not initialise: {e}",
                    "on a GPU node install the NVIDIA driver; elsewhere this is expected")
    return ok("nvml", f"NVML sees {n} GPU(s), driver {drv.decode() if isinstance(drv, bytes) else drv}")


def driver_memory_caps() -> str:
    """Whether this node's driver can cap a job's GPU memory itself (MPS v3 memory partitioning,
    ``slurm_antman.sidecar.driver_caps``): "" when it can, else why not."""
    from .sidecar import driver_caps

    try:
        import pynvml
    except ImportError:
        return "no nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return f"no NVML ({e})"
    try:
        return driver_caps.detect(pynvml).why_not
    finally:
        pynvml.nvmlShutdown()


def check_enforcement(cfg: cfgmod.AntmanConfig, sconf: Optional[dict[str, str]],
                      caps: Callable[[], str] = driver_memory_caps) -> Check:
    """Which enforcement is in force for opportunistic jobs on this node, from the strongest down."""
    if not cfg.sidecar.enforce:
        return warn("enforcement", "sidecar.enforce is false: observe only, no limit reaches any job",
                    "set sidecar.enforce: true once the rollout is over")
    parts = ["limits applied by each job's agent",
             f"jobs that ignore them requeued after {cfg.sidecar.compliance_grace_s:g} s (slurm_antman.policy.node.compliance)"]
    proctrack = (sconf or {}).get("ProctrackType", "")
    telemetry = cfg.sidecar.telemetry
    if telemetry == "emulated":
        parts.append("jobs without an agent invisible (emulated telemetry: no GPU processes to see)")
    elif proctrack != "proctrack/cgroup":
        parts.append(f"jobs without an agent invisible: their GPU processes cannot be mapped to jobs "
                     f"(ProctrackType={proctrack or 'unknown'}, not proctrack/cgroup)")
    else:
        parts.append("jobs without an agent found through NVML and Slurm's cgroups")
    why_not = caps()
    parts.append("driver memory caps (MPS v3 memory partitioning) set by the sidecar on every opportunistic job: "
                 "its limit plus the compliance tolerance" if not why_not else f"no driver memory caps ({why_not})")
    return ok("enforcement", "; ".join(parts))


def _read_associations(cluster: str) -> list:
    from .slurm.cli_backend import CliBackend

    return CliBackend(timeout=COMMAND_TIMEOUT_S).associations(cluster)


def check_quotas(cfg: cfgmod.AntmanConfig, sconf: dict[str, str],
                 read: Callable[[str], list] = _read_associations) -> Check:
    """Which source the coordinator takes tenant quotas from, and where antman.yaml and accounting
    disagree (the coordinator follows the source in force; a disagreement is an admin's to settle)."""
    source = cfg.coordinator.quota_source
    storage = sconf.get("AccountingStorageType", "")
    yaml_q = tenants.quotas_from_config(cfg)
    yaml_text = f"antman.yaml tenants ({len(yaml_q)})"
    if storage != tenants.SLURMDBD:
        if source == "accounting":
            return fail("quotas", f"quota_source is accounting but Slurm runs with AccountingStorageType="
                                  f"{storage or '(unset)'}", f"set AccountingStorageType={tenants.SLURMDBD} in slurm.conf "
                                  "(with slurmdbd), or coordinator.quota_source: auto")
        return ok("quotas", f"{yaml_text}: Slurm has no accounting storage ({storage or 'unset'})")
    tres = f"gres/{cfg.slurm.gpu_gres}"
    tracked = [t.strip() for t in sconf.get("AccountingStorageTRES", "").split(",")]
    if source != "antman_yaml" and tres not in tracked:
        return warn("quotas", f"Slurm accounting does not track {tres} (AccountingStorageTRES="
                              f"{sconf.get('AccountingStorageTRES', '') or '(unset)'}): no account can have a GPU quota "
                              "there, so every tenant is unlimited", f"add {tres} to AccountingStorageTRES in slurm.conf "
                              "and restart slurmctld; then sacctmgr ... set GrpTRES=" + tres + "=N")
    try:
        reading = tenants.quotas_from_associations(read(cfg.cluster_name), cfg.cluster_name, cfg.slurm.gpu_gres)
    except SlurmError as e:
        in_force = yaml_text if source == "antman_yaml" else "the last quotas the coordinator read from accounting"
        return warn("quotas", f"{in_force}; cannot read accounting: {e}",
                    "start slurmdbd (and its database); sacctmgr show associations must answer")
    in_force = (f"{yaml_text} (quota_source: antman_yaml overrides accounting)" if source == "antman_yaml" else
                "Slurm accounting (GrpTRES=gres/%s on %d account(s)%s)" % (
                    cfg.slurm.gpu_gres, len(reading.quotas),
                    ": " + ", ".join(f"{a}={n}" for a, n in sorted(reading.quotas.items())) if reading.quotas else ""))
    issues = [*reading.problems, *(tenants.disagreements(yaml_q, reading, cfg.cluster_name, cfg.slurm.gpu_gres)
                                   if yaml_q or source == "antman_yaml" else [])]
    if issues:
        more = f" (+{len(issues) - 1} more, in the hint)" if len(issues) > 1 else ""
        return Check("quotas", "warn", f"{in_force}; {issues[0]}{more}",
                     "make antman.yaml tenants and sacctmgr agree (or drop the tenants from antman.yaml); all: "
                     + " | ".join(issues))
    return ok("quotas", in_force)


def controller_time() -> tuple[Optional[float], str]:
    """slurmctld's own clock (``sdiag``), or why it cannot be read."""
    try:
        return _slurm().controller_time(), ""
    except SlurmOutputError as e:
        return None, e.message
    except SlurmError as e:
        return None, _why(e)


def check_clock(get_time: Callable[[], tuple[Optional[float], str]] = controller_time) -> Check:
    before = time.time()
    theirs, err = get_time()
    after = time.time()
    if theirs is None:
        return warn("clock_skew", f"cannot read slurmctld's time: {err}", "check that sdiag works here")
    # sdiag gives whole seconds: a skew under the round trip plus one second is no skew.
    mid = (before + after) / 2
    skew = theirs - mid
    slack = (after - before) / 2 + 1.0
    size = max(0.0, abs(skew) - slack)
    if size > SKEW_FAIL_S:
        return fail("clock_skew", f"this host's clock is {skew:+.0f} s off slurmctld's",
                    "run chrony/ntpd on every host; munge rejects credentials from skewed clocks")
    if size > SKEW_WARN_S:
        return warn("clock_skew", f"this host's clock is {skew:+.0f} s off slurmctld's", "run chrony/ntpd")
    return ok("clock_skew", f"within {slack:.1f} s of slurmctld")


def check_socket_dir(cfg: cfgmod.AntmanConfig) -> Check:
    d = cfg.sidecar.socket_dir
    try:
        st = os.stat(d)
    except FileNotFoundError:
        return warn("socket_dir", f"{d} does not exist yet", "the sidecar creates it at start "
                    "(the systemd unit's RuntimeDirectory= does too)")
    except OSError as e:
        return fail("socket_dir", f"cannot stat {d}: {e.strerror}", "check the path in sidecar.socket_dir")
    if not stat.S_ISDIR(st.st_mode):
        return fail("socket_dir", f"{d} is not a directory", "remove it; the sidecar creates the directory")
    if st.st_uid != 0:
        return fail("socket_dir", f"{d} is owned by uid {st.st_uid}, not root",
                    f"chown root:root {d}: whoever owns it can replace any job's sockets")
    if st.st_mode & stat.S_IWOTH or st.st_mode & stat.S_IWGRP:
        return fail("socket_dir", f"{d} is group/world-writable (mode {stat.S_IMODE(st.st_mode):o})",
                    f"chmod 755 {d}: anyone could create a fake sidecar socket there")
    return ok("socket_dir", f"{d} root-owned, mode {stat.S_IMODE(st.st_mode):o}")


def run_checks(config_path: str, node: str) -> list[Check]:
    checks: list[Check] = []
    cfg, c = check_config(config_path)
    checks.append(c)
    sconf, c = slurm_config()
    checks.append(c)
    need_cfg = "antman.yaml is not valid"
    need_slurm = "Slurm does not answer"
    checks.append(check_plugin_file(cfg) if cfg else skip("spank_plugin", need_cfg))
    if cfg and sconf:
        checks.append(check_plugstack(cfg, sconf))
    else:
        checks.append(skip("plugstack", need_cfg if not cfg else need_slurm))
    checks.append(check_sbatch_option())
    if cfg and sconf and Path(cfg.plugin_path).is_file():
        checks.append(check_versions(cfg, sconf))
    else:
        checks.append(skip("slurm_version", need_slurm if not sconf else "no plugin file to read"))
    if cfg and sconf:
        checks += check_slurm_conf(cfg, sconf)
    else:
        checks.append(skip("slurm_conf", need_cfg if not cfg else need_slurm))
    checks.append(check_job_submit(sconf) if sconf else skip("job_submit", need_slurm))
    checks.append(check_quota_file(cfg, sconf) if cfg else skip("quota_file", need_cfg))
    checks.append(check_hooks(sconf) if sconf else skip("prolog_epilog", need_slurm))
    checks.append(check_agent_bundle(cfg, node) if cfg else skip("agent_bundle", need_cfg))
    checks.append(check_sidecar(cfg, node) if cfg else skip("sidecar", need_cfg))
    checks.append(check_coordinator(cfg, node) if cfg else skip("coordinator_link", need_cfg))
    checks.append(check_nvml())
    checks.append(check_enforcement(cfg, sconf) if cfg else skip("enforcement", need_cfg))
    checks.append(check_quotas(cfg, sconf) if cfg and sconf else skip("quotas", need_cfg if not cfg else need_slurm))
    checks.append(check_clock() if sconf else skip("clock_skew", need_slurm))
    checks.append(check_socket_dir(cfg) if cfg else skip("socket_dir", need_cfg))
    return checks


_MARK = {"ok": "OK  ", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


def render_text(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    out = []
    for c in checks:
        out.append(f"{_MARK[c.status]}  {c.name:<{width}}  {c.reason}")
        if c.hint:
            out.append(f"      {'':<{width}}  hint: {c.hint}")
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    out.append(f"{failed} failed, {warned} warning(s), {sum(c.status == 'ok' for c in checks)} ok")
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="antman doctor", description="check a slurm-antman node or controller")
    ap.add_argument("--config", default=None,
                    help="antman.yaml (default: $ANTMAN_CONFIG or /etc/slurm-antman/antman.yaml)")
    ap.add_argument("--node", default=None, help="Slurm node name of this host (default: short hostname)")
    ap.add_argument("--json", action="store_true", help="one JSON object per check, in a list")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    path = a.config or os.environ.get("ANTMAN_CONFIG", "/etc/slurm-antman/antman.yaml")
    node = a.node or socket.gethostname().split(".")[0]
    checks = run_checks(path, node)
    if a.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        sys.stdout.write(render_text(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
