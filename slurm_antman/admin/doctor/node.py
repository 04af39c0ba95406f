"""Checks of this host as a GPU node: the agent bundle and SPANK plugin file, the sidecar, its link to
the coordinator, NVML, which enforcement is in force, whether an opportunistic job's GPU can be granted
(device control), and the sidecar's socket directory."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import Callable, Optional

from slurm_antman import config as cfgmod
from slurm_antman import device_failure
from slurm_antman.slurm import cgroup_conf
from .report import Check, fail, ok, skip, warn

def check_agent_bundle(cfg: cfgmod.AntmanConfig, node: str) -> Check:
    """The agent bundle a GPU node's jobs load the agent from (agent_path): there, whole, readable
    by every job's user, and of this release."""
    from slurm_antman import __version__
    from slurm_antman.admin import agent_bundle

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


def check_sidecar(cfg: cfgmod.AntmanConfig, node: str) -> Check:
    if node not in cfg.node_groups_by_host():
        return skip("sidecar", f"{node} is not a GPU node in antman.yaml (controller host?)")
    from slurm_antman.clients import sidecar_control as client

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

    from slurm_antman import curve_keys

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


def _mem_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_pin_budget(cfg: cfgmod.AntmanConfig, node: str, mem_total: Callable[[], Optional[int]] = _mem_total_bytes) -> Check:
    """The pinned memory opportunistic jobs may hold for pauses (sidecar.pin_budget_mb) against this node's
    RAM: page-locked memory cannot be swapped or reclaimed, so a budget near the RAM starves the jobs' own
    host memory (data loaders) and the system."""
    budget = cfg.pin_budget_bytes(node)
    total = mem_total()
    if total is None:
        return skip("pin_budget", "cannot read MemTotal from /proc/meminfo")
    share = budget / total
    said = f"{budget >> 20} MiB of {total >> 20} MiB RAM ({share:.0%})"
    if budget == 0:
        return ok("pin_budget", "no memory kept pinned for pauses (sidecar.pin_budget_mb: 0): first pauses pin afresh")
    if share > 0.5:
        return fail("pin_budget", f"sidecar.pin_budget_mb is {said}: over half the node's memory",
                    "lower sidecar.pin_budget_mb (default: an eighth of nodes[].memory_mb)")
    if share > 0.25:
        return warn("pin_budget", f"sidecar.pin_budget_mb is {said}: jobs' own host memory may run short",
                    "an eighth of the RAM (the default) holds a few paused jobs' states")
    return ok("pin_budget", f"pinned memory for pauses: {said}")


def driver_memory_caps() -> str:
    """Whether this node's driver can cap a job's GPU memory itself (MPS v3 memory partitioning,
    ``slurm_antman.sidecar.driver_caps``): "" when it can, else why not."""
    from slurm_antman.sidecar import driver_caps

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


def check_device_control(cfg: cfgmod.AntmanConfig, node: str, slurm_conf: Optional[str] = None,
                         mounts: str = "/proc/self/mounts", now: Optional[float] = None) -> Check:
    """Whether the SPANK plugin can grant an opportunistic job its placed GPU here: which cgroup hierarchy
    the node runs, which plugin cgroup.conf names, and whether a recent grant failed (device_failure)."""
    if not cgroup_conf.constrain_devices(slurm_conf):
        return ok("device_control", "ConstrainDevices is off (cgroup.conf): jobs are not confined to their "
                                    "devices, so there is nothing to grant")
    try:
        with open(mounts, encoding="ascii", errors="replace") as f:
            kind = cgroup_conf.hierarchy(f.read())
    except OSError as e:
        return fail("device_control", f"cannot read {mounts}: {e.strerror}", "run antman doctor on the node itself")
    plugin = cgroup_conf.cgroup_plugin(slurm_conf)
    hint_v2 = "docs/admin.md, \"A node that boots the unified cgroup v2 hierarchy\""
    if kind == "hybrid" and plugin == "cgroup/v2":
        return fail("device_control", "CgroupPlugin=cgroup/v2 on a hybrid node (cgroup v1 controllers beside "
                    "cgroup2): Slurm's cgroup/v2 refuses it (\"Hybrid mode is not supported\")",
                    "boot the unified hierarchy (systemd.unified_cgroup_hierarchy=1) or set CgroupPlugin=cgroup/v1")
    if kind == "unified" and plugin == "cgroup/v1":
        return fail("device_control", "CgroupPlugin=cgroup/v1 on a node that boots the unified cgroup v2 hierarchy",
                    f"set CgroupPlugin=autodetect (or cgroup/v2); see {hint_v2}")
    if kind in ("none", "hybrid"):
        return fail("device_control", f"ConstrainDevices=yes but no devices controller Slurm can use here "
                    f"(cgroup hierarchy: {kind})", f"see {hint_v2}")
    how = ("cgroup v1: the plugin writes devices.allow" if kind == "v1" else
           "unified cgroup v2: the plugin amends the task cgroup's eBPF device program")
    recent = device_failure.problem(os.path.join(cfg.state_dir, node), time.time() if now is None else now)
    if recent:
        return warn("device_control", f"{how}; a grant failed recently: {recent}",
                    "the cause is in slurmd's log (\"antman: job N: cannot allow its GPU\"); " + hint_v2)
    return ok("device_control", f"{how} (CgroupPlugin={plugin or 'autodetect'}, ConstrainDevices=yes)")
