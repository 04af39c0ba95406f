"""Whether the node can record what the sidecar and the hooks do for a job: its state directories.

An opportunistic job started on a node whose state directory is full could not get the env file
that carries its limits, nor the record that lets a restarted sidecar find it again, nor even the
refusal that keeps it from starting. Such a node takes no new opportunistic job until space is back
(the coordinator keeps pending ones off it; the sidecar answers the Prolog ``wait``), rather than
have Slurm start and requeue the same job there again and again. Running jobs are not touched.
"""

from __future__ import annotations

import os
from typing import Iterable

# Below this the next env file or job record may not fit: a few KiB each, with room for the
# hooks' log lines and the temp files written beside them.
MIN_FREE_BYTES = 1 << 20


def state_dir_problem(path: str, min_free_bytes: int = MIN_FREE_BYTES) -> str:
    """Why ``path``'s filesystem cannot take a new job's records; "" when it can, or when the directory
    does not exist yet (whoever writes there first creates it). Counted as root, who writes there:
    blocks reserved for root are free to it."""
    try:
        st = os.statvfs(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"cannot check {path}: {e.strerror}"
    if st.f_flag & os.ST_RDONLY:
        return f"{path} is read-only"
    free = st.f_bfree * st.f_frsize
    if free < min_free_bytes:
        return f"{path} is full ({free} bytes free, {min_free_bytes} needed)"
    if st.f_files and st.f_ffree == 0:
        return f"{path} has no free inodes"
    return ""


def node_problem(paths: Iterable[str], min_free_bytes: int = MIN_FREE_BYTES) -> str:
    """The first problem among the node's state directories; "" when all can take a new job."""
    for path in paths:
        why = state_dir_problem(path, min_free_bytes)
        if why:
            return why
    return ""
