"""Elastic width, the agent's side (docs/elastic.md): hand a new GPU list to the job's launcher.

The agent of local rank 0 under ``torch_patch.elastic_launch`` (it alone gets the launcher's socket,
``ANTMAN_LAUNCHER_SOCKET``) runs the job's checkpoint hooks at the boundary after a ``width``, then
:func:`hand_over`: ``width_done`` to the sidecar, handed to ZeroMQ first because the launcher stops
this process as soon as it reads the datagram ``{"seq": N, "gpus": [...]}`` sent next.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Optional

from slurm_antman import protocol as P

from .client import ProtocolClient, WidthRequest

log = logging.getLogger("torch_patch")


def hand_over(client: Optional[ProtocolClient], req: WidthRequest, path: str, checkpoint_ms: float,
              arrived_during: int) -> bool:
    """True once the launcher has the list. False when its socket cannot be reached: the sidecar is
    answered ``error`` (``internal``) instead of ``width_done``, and the job goes on as it is."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        try:
            sock.connect(path)
        except OSError as e:
            log.error("slurm-antman: cannot reach the elastic launcher at %s (%s); the width stays", path, e)
            if client is not None:
                client.send(P.Error(code=P.ErrorCode.internal.value,
                                    message=f"width seq {req.seq}: the launcher's socket {path}: {e}"[:4096]),
                            ref=req.ref)
            return False
        if client is not None:
            client.send(P.WidthDone(seq=req.seq, checkpoint_ms=checkpoint_ms), ref=req.ref, wake=False)
            client.flush_now(arrived_during)
        try:
            sock.send(json.dumps({"seq": req.seq, "gpus": list(req.gpus)}, separators=(",", ":")).encode())
        except OSError as e:
            log.error("slurm-antman: could not hand width seq %d to the launcher at %s: %s", req.seq, path, e)
            return False
        return True
    finally:
        sock.close()
