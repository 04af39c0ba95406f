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
