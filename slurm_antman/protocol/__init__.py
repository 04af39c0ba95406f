"""The slurm-antman ZeroMQ protocol, version 1: messages between the node sidecar, the in-job agents,
the node's control clients (Prolog, Epilog, CLI) and the cluster coordinator. docs/protocol.md is the specification; this
package is its one implementation, shared by every side: spec.py (version, limits, names, error codes),
messages.py (the bodies, channel by channel), codec.py (validation, envelope, encode and decode) and
paths.py (where the sockets are). Everything is imported from here (``from slurm_antman import
protocol as p``).

A message is two ZeroMQ frames: the marker ``b"ANTMAN"`` and a UTF-8 JSON envelope
``{"v", "type", "id", "ts", "ref", "body"}``. A ROUTER peer sees its routing identity frame(s) in
front; strip them before :func:`decode`.

Decoding is hand-rolled rather than pydantic because an agent sends a ``report`` per training
iteration, and the sidecar must keep up with many of them: validation is a table of small checker
closures compiled once per message type.
"""

from .codec import *  # noqa: F401,F403
from .messages import *  # noqa: F401,F403
from .paths import *  # noqa: F401,F403
from .spec import *  # noqa: F401,F403
