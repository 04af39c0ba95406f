"""Where a node's sockets are: the control socket and each job's agent socket under the socket directory."""

from __future__ import annotations

import os

from .spec import AGENT_SOCKET_NAME, CONTROL_SOCKET_NAME, JOB_ID_RE

# ---------------------------------------------------------------------------------------------
# Endpoints.

def control_path(socket_dir: str) -> str:
    return os.path.join(socket_dir, CONTROL_SOCKET_NAME)


def job_dir(socket_dir: str, job_id: str) -> str:
    if not JOB_ID_RE.match(job_id):
        raise ValueError(f"job id {job_id!r} must be 1-10 digits")
    return os.path.join(socket_dir, "jobs", job_id)


def agent_path(socket_dir: str, job_id: str) -> str:
    return os.path.join(job_dir(socket_dir, job_id), AGENT_SOCKET_NAME)


def ipc(path: str) -> str:
    return "ipc://" + path
