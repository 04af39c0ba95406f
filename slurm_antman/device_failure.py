"""A node that could not grant an opportunistic job its GPU: the record the hooks leave, and what the
sidecar makes of it.

With ``ConstrainDevices=yes`` an opportunistic job may open its placed GPU only because the SPANK
plugin amends Slurm's device rules for its task (cgroup v1 ``devices.allow``; on cgroup v2 the eBPF
program of the task's cgroup: spank/README.md, "Devices under cgroup v2"). Where that fails (a program
the plugin does not know how to amend, BPF refused, a hybrid node) the plugin fails the task rather than
let it run without its GPU, and runs the Prolog hook with ``ANTMAN_DEVICE_FAILURE``; the hook requeues
the job and leaves this record in the node's state directory. What failed for one job fails for the
next, so while the record is fresh the sidecar reports the node unhealthy: the coordinator keeps
opportunistic jobs off it and says why in ``antman explain``, instead of Slurm starting and requeueing
them there in a loop. Guaranteed and plain jobs are not touched: their GPUs are Slurm's own rules.

The record expires after ``HOLD_S``, so a passing failure (BPF memory, a racing step) costs the node a
few minutes of opportunistic work; an admin who fixed the node removes it at once.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Optional

FILE_NAME = "device-failure.json"
# How long one failure keeps opportunistic jobs off the node: long enough that a broken node costs a
# requeue every ten minutes rather than every scheduling pass, short enough that a passing failure is
# soon forgotten.
HOLD_S = 600.0
MAX_BYTES = 4096


def path(hooks_state_dir: str | os.PathLike[str]) -> Path:
    """``STATE_DIR/NODE/device-failure.json``: beside the node's ``jobs/`` directory of env files."""
    return Path(hooks_state_dir) / FILE_NAME


def record(hooks_state_dir: str | os.PathLike[str], job_id: str, cause: str, now: Optional[float] = None) -> Path:
    """Write the record (atomically: the sidecar reads it at any moment). ``cause`` is the plugin's own
    text; it is kept to one line of at most 512 characters."""
    cause = " ".join(cause.replace("\0", " ").split())[:512]
    data = {"job_id": str(job_id), "cause": cause, "ts": round(time.time() if now is None else now, 3)}
    out = path(hooks_state_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{FILE_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, out)
    return out


def problem(hooks_state_dir: Optional[str | os.PathLike[str]], now: float, hold_s: float = HOLD_S) -> str:
    """Why no opportunistic job may start on this node because of a device failure; "" when there is no
    fresh record. Only a regular file owned by root (who runs the hooks) counts: nothing a job can write
    takes a node out of service."""
    if not hooks_state_dir:
        return ""
    p = path(hooks_state_dir)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_size > MAX_BYTES:
            return ""
        data = json.loads(os.read(fd, MAX_BYTES).decode("utf-8", errors="replace"))
        ts, cause, job_id = float(data["ts"]), str(data["cause"]), str(data["job_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    finally:
        os.close(fd)
    if not 0 <= now - ts < hold_s:
        return ""
    until = time.strftime("%H:%M:%S", time.localtime(ts + hold_s))
    return (f"job {job_id}'s GPU could not be granted here ({cause}); no opportunistic job starts here until "
            f"{until}, or until an admin who fixed the node's device control removes {p}")
