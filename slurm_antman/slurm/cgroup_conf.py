"""What a node's cgroup.conf says that slurm-antman must follow.

With ``ConstrainDevices=yes`` Slurm lets a job open only the GPUs it holds and numbers them from 0
in CUDA_VISIBLE_DEVICES (the job sees no other GPU, so the first allowed one is CUDA device 0;
checked on Slurm 22.05: a job holding GPU 1 gets ``CUDA_VISIBLE_DEVICES=0``). The Prolog gives an
opportunistic job the same view of the GPUs the sidecar placed it on.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"


def cgroup_conf_path(slurm_conf: str | None = None) -> Path:
    """cgroup.conf sits beside slurm.conf (Slurm reads it from the same directory)."""
    conf = slurm_conf or os.environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF
    return Path(conf).parent / "cgroup.conf"


def parse(text: str) -> dict[str, str]:
    """``Key=Value`` lines, keys lower-cased (Slurm's are case-insensitive), comments dropped; the
    last of a repeated key wins, as in Slurm's own parser."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out[key.strip().lower()] = value.strip()
    return out


def constrain_devices(slurm_conf: str | None = None) -> bool:
    """Whether this node's Slurm confines jobs to the devices they hold. No cgroup.conf: no."""
    try:
        text = cgroup_conf_path(slurm_conf).read_text()
    except FileNotFoundError:
        return False
    return parse(text).get("constraindevices", "no").lower() in ("yes", "true", "1")


def cgroup_plugin(slurm_conf: str | None = None) -> str:
    """cgroup.conf's ``CgroupPlugin`` (Slurm's default: ``autodetect``); "" without a cgroup.conf."""
    try:
        text = cgroup_conf_path(slurm_conf).read_text()
    except FileNotFoundError:
        return ""
    return parse(text).get("cgroupplugin", "autodetect")


def hierarchy(mounts_text: str) -> str:
    """Which cgroup hierarchy a node runs, from /proc/self/mounts (the same reading as the SPANK plugin's
    cgroup_device_control in spank/cgroup_bpf.c): ``v1`` (a cgroup v1 hierarchy holds the devices
    controller), ``unified`` (cgroup2 and no v1 controller: device rules are eBPF programs), ``hybrid`` (v1
    controllers without devices, cgroup2 beside them) or ``none``."""
    v1_devices = v1_any = v2 = False
    for line in mounts_text.splitlines():
        f = line.split()
        if len(f) < 4:
            continue
        if f[2] == "cgroup2":
            v2 = True
        elif f[2] == "cgroup":
            opts = set(f[3].split(","))
            if "devices" in opts:
                v1_devices = True
            if any(not o.startswith("name=") and o not in ("rw", "ro", "nosuid", "nodev", "noexec", "relatime",
                                                            "clone_children", "xattr", "noprefix")
                   for o in opts):
                v1_any = True
    if v1_devices:
        return "v1"
    if v2 and not v1_any:
        return "unified"
    if v2:
        return "hybrid"
    return "none"
