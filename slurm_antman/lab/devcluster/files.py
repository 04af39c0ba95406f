"""The files a devcluster runs on: its antman.yaml, slurm.conf and cgroup.conf, the SPANK plugin built
from this checkout, the emulated GPU device nodes, and where each daemon keeps its sockets and spool."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

import slurm_antman
from slurm_antman.slurm import version as slurm_version

from .processes import DevclusterError, systemd_running, unified_cgroup_host  # noqa: F401 - the cluster asks here



# The source checkout (the SPANK sources, etc/): the directory that holds the slurm_antman package.
REPO = Path(slurm_antman.__file__).resolve().parents[1]

DEFAULT_PORT_BASE = 17817


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
        # Two, not the default three: the devcluster's tests size their emulated GPUs and bursts for
        # two opportunistic jobs beside a guaranteed one.
        "opportunistic": {"slots_per_gpu": 2},
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

def cgroup_conf(unified: bool, systemd: bool = True, constrain: bool = True) -> str:
    """cgroup.conf for a devcluster: jobs confined to the devices they hold, as at a GPU site. On a unified
    cgroup v2 host ``autodetect`` (what sites set) finds cgroup/v2, whose device rules are eBPF programs;
    elsewhere cgroup/v1 is named, since autodetect would refuse a hybrid host's cgroup2. A unified host
    that does not run systemd (a bare VM, the GPU machine of ``make gpu-site-proof``) has nobody to ask
    for slurmstepd's scope: ``IgnoreSystemd=yes`` (Slurm 22.05 and later) makes slurmd create it itself,
    and ``CgroupAutomount=yes`` enable the controllers on the way. slurmd loads its cgroup plugin even
    without task/cgroup, so such a host needs this file unconfined too (``constrain=False``)."""
    plugin = "autodetect" if unified else "cgroup/v1"
    own = []
    if unified and not systemd:
        plugin, own = "cgroup/v2", ["IgnoreSystemd=yes", "CgroupAutomount=yes"]
    return "\n".join([
        "# Generated by `antman devcluster up`: jobs confined to the devices they hold, as at a GPU site.",
        f"CgroupPlugin={plugin}", *own,
        f"ConstrainDevices={'yes' if constrain else 'no'}",
        # Cores and memory are not what the devcluster tests, and a 2-core host over-claims both.
        "ConstrainCores=no", "ConstrainRAMSpace=no", "ConstrainSwapSpace=no",
    ]) + "\n"


def first_job_id(port_base: int) -> int:
    """Job ids of clusters on one host must not meet: Slurm's cgroup v1 tree is shared by every
    slurmd of the host (``/sys/fs/cgroup/devices/slurm_NODE/uid_U/job_J``), and two clusters both
    naming a node node1 would put their jobs J in one cgroup. Each port base gets its own range."""
    return (port_base % 10000) * 1000 + 1


def _base_slurm_conf(d: Path, port_base: int, with_antman: bool, accounting: list[str] | None = None,
                     version: tuple[int, int, int] = (22, 5, 0), cgroups: bool = True,
                     ctl_addr: Optional[str] = None, topology: bool = False,
                     carried: Sequence[str] = ()) -> str:
    """``accounting``: the slurm.conf lines that point slurmctld at the devcluster's slurmdbd;
    ``version``: the installed Slurm's (what differs by version comes from slurm_antman.slurm.version);
    ``cgroups``: confine jobs to their devices (task/cgroup, ConstrainDevices=yes), as GPU sites do;
    ``topology``: switches from topology.conf beside slurm.conf (topology/tree; see ``topology_conf``);
    ``carried``: the lines a Slurm carried into a prefix needs (its PluginDir, its munged's socket)."""
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
        *(["TopologyPlugin=topology/tree"] if topology else []),
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
        *carried,
        f"Include {d}/etc/antman.slurm.conf",
    ]
    return "\n".join(lines) + "\n"


def switch_groups(nodes: list[str], switches: int) -> dict[str, list[str]]:
    """The leaf switches of a devcluster with ``switches`` of them: ``s0``, ``s1``, ... each over a run of
    consecutive nodes, the first ones one node larger when the nodes do not divide evenly (4 nodes, 2
    switches: s0 node1,node2; s1 node3,node4)."""
    if not 1 <= switches <= len(nodes):
        raise DevclusterError(f"--switches must be between 1 and the number of nodes ({len(nodes)}), not {switches}")
    size, extra = divmod(len(nodes), switches)
    groups, start = {}, 0
    for i in range(switches):
        n = size + (1 if i < extra else 0)
        groups[f"s{i}"] = nodes[start:start + n]
        start += n
    return groups


def topology_conf(nodes: list[str], switches: int) -> str:
    """topology.conf for topology/tree: the leaf switches of ``switch_groups``, and above several of them one
    switch, ``top``, that joins them (Slurm then counts a job on two leaves as on 3 switches)."""
    groups = switch_groups(nodes, switches)
    lines = ["# Generated by `antman devcluster up --switches N`: emulated leaf switches for topology/tree."]
    lines += [f"SwitchName={name} Nodes={','.join(members)}" for name, members in groups.items()]
    if len(groups) > 1:
        lines.append(f"SwitchName=top Switches={','.join(groups)}")
    return "\n".join(lines) + "\n"


def build_spank(dest: Path) -> Path:
    """Build the SPANK plugin from the source tree (so the devcluster always runs the current code), against
    the Slurm headers under ``$SLURM_INCLUDE`` (default /usr/include), in a build directory of that Slurm's
    own: one checkout serves clusters of several releases at once (the host's, a chroot's, a guest's)
    without one build overwriting another's objects."""
    src = REPO / "spank"
    if not (src / "Makefile").exists():
        raise DevclusterError(f"{src}/Makefile missing: the SPANK plugin sources are not in this checkout")
    include = Path(os.environ.get("SLURM_INCLUDE") or "/usr/include")
    try:
        header = (include / "slurm" / "slurm_version.h").read_text()
        number = re.search(r"^#define SLURM_VERSION_NUMBER\s+(\S+)", header, re.M).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        raise DevclusterError(f"no Slurm headers in {include}/slurm (install libslurm-dev, or set SLURM_INCLUDE)") from None
    build = src / f"build-{number}"
    r = subprocess.run(["make", "-s", "-C", str(src), f"BUILDDIR={build}", f"SLURM_INCLUDE={include}"],
                       capture_output=True, text=True)
    if r.returncode:
        raise DevclusterError(f"building the SPANK plugin failed:\n{r.stdout}{r.stderr}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "antman_spank.so", dest)
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
