"""The protocol's fixed parts: its version and limits, the names every side shares (socket names, the
environment variables C, Lua and Python agree on), the error codes, and how a message body declares
its fields (wire type and bounds in dataclass metadata, read by codec.py)."""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Optional


PROTOCOL_VERSION = 1
MARKER = b"ANTMAN"
MAX_MESSAGE_BYTES = 1 << 20
# Every number on the wire is within +-2^53 (what a JSON number holds exactly, RFC 8259 section 6),
# whatever narrower bound its field has: a peer can send nothing a sum or a str() cannot handle.
MAX_NUMBER = 1 << 53


def clamp_number(v: int) -> int:
    """A sum of bounded numbers (e.g. the memory several agents of one job report), kept sendable."""
    return min(v, MAX_NUMBER)

CONTROL_SOCKET_NAME = "control.sock"
AGENT_SOCKET_NAME = "agent.sock"
# The agent finds its endpoint in this variable (set from the Prolog's job env file).
ENDPOINT_ENV = "ANTMAN_SIDECAR_ENDPOINT"
# The other names C, Lua and Python share (docs/protocol.md, "Environment variables"; the tests
# compare each language's copy with docs/contracts.json).
ENV_CLASS = "ANTMAN_CLASS"
ENV_SPANK_CLASS = "SPANK_ANTMAN_CLASS"
ENV_JOB_SPANK_CLASS = "SLURM_SPANK_ANTMAN_CLASS"
ENV_JOB_ID = "ANTMAN_JOB_ID"
ENV_NODE = "ANTMAN_NODE"
ENV_GPUS = "ANTMAN_GPUS"
ENV_GPU_DEVICES = "ANTMAN_GPU_DEVICES"
ENV_REFUSED = "ANTMAN_REFUSED"
ENV_JOB_NODEID = "ANTMAN_JOB_NODEID"
ENV_PROLOG_FROM_SPANK = "ANTMAN_PROLOG_FROM_SPANK"
ENV_DEVICE_FAILURE = "ANTMAN_DEVICE_FAILURE"
ENV_AGENT_DISABLE = "ANTMAN_AGENT_DISABLE"
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
# Elastic width (docs/elastic.md): the user's --antman-elastic=MIN:MAX, and the socket of
# the job's elastic launcher, through which the agent of local rank 0 hands it a new GPU list.
ENV_ELASTIC = "ANTMAN_ELASTIC"
ENV_SPANK_ELASTIC = "SPANK_ANTMAN_ELASTIC"
ENV_JOB_SPANK_ELASTIC = "SLURM_SPANK_ANTMAN_ELASTIC"
ENV_LAUNCHER_SOCKET = "ANTMAN_LAUNCHER_SOCKET"

# \Z, not $: $ also matches before a final newline, which would let "7\n" through as a job id.
JOB_ID_RE = re.compile(r"^[0-9]{1,10}\Z")
# Slurm node names; they also become key file names on the coordinator.
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}\Z")
ENVELOPE_KEYS = frozenset(("v", "type", "id", "ts", "ref", "body"))
MAX_ID_LEN = 128


class ErrorCode(str, enum.Enum):
    """Codes carried by ``error`` messages and by :class:`ProtocolError`. docs/protocol.md lists them."""

    bad_frames = "bad_frames"
    too_large = "too_large"
    bad_json = "bad_json"
    bad_envelope = "bad_envelope"
    version_mismatch = "version_mismatch"
    unknown_type = "unknown_type"
    missing_field = "missing_field"
    extra_field = "extra_field"
    bad_type = "bad_type"
    bad_value = "bad_value"
    wrong_direction = "wrong_direction"
    not_registered = "not_registered"
    unknown_job = "unknown_job"
    forbidden = "forbidden"
    internal = "internal"
    # The query channel's (a munge credential that munged refused, or a peer asking too often).
    bad_credential = "bad_credential"
    expired_credential = "expired_credential"
    replayed_credential = "replayed_credential"
    rate_limited = "rate_limited"


class ProtocolError(Exception):
    """A message that cannot be used. ``ref`` is the offending message's id when it could be read."""

    def __init__(self, code: ErrorCode, message: str, ref: Optional[str] = None,
                 peer_version: Optional[int] = None):
        self.code = ErrorCode(code)
        self.message = message
        self.ref = ref
        self.peer_version = peer_version
        super().__init__(f"{self.code.value}: {message}")


# ---------------------------------------------------------------------------------------------
# Field declarations. Each body field carries its wire type and constraints in dataclass
# metadata, so one declaration drives both the Python API and the validator.

_MISSING = dataclasses.MISSING


def _f(kind: Any, *, nullable: bool = False, ge: Optional[float] = None, gt: Optional[float] = None,
       le: Optional[float] = None, choices: Optional[Iterable[str]] = None,
       pattern: Optional[re.Pattern[str]] = None, max_len: Optional[int] = None,
       default: Any = _MISSING, omit_default: bool = False) -> Any:
    """``omit_default``: the encoder leaves the field out while it holds its default, so a peer older
    than the field (which answers an unknown field with ``extra_field``) never meets it unless it is
    actually used; a sender uses it only towards peers that said they know it (``register.features``)."""
    meta = dict(kind=kind, nullable=nullable, ge=ge, gt=gt, le=le,
                choices=frozenset(choices) if choices is not None else None,
                pattern=pattern, max_len=max_len, omit_default=omit_default)
    return field(default=default, metadata=meta)


JOB_CLASSES = ("guaranteed", "opportunistic")
AGENT_CLASSES = ("guaranteed", "opportunistic", "none")
DEVICES = ("cuda", "cpu")
THROTTLE_MODES = ("off", "iteration", "launch")
TELEMETRY_KINDS = ("nvml", "emulated")
PLACEMENTS = ("requested", "fit", "fallback", "wait")
FEATURE_PAUSE = "pause"  # register.features: the agent answers pause / resume
# register.features: the agent runs under the elastic launcher (local rank 0 only) and answers width
FEATURE_WIDTH = "width"
# register.features: the agent publishes its GPU phases into an idle-slot page (guaranteed) or launches
# into the idle slots a page shows (opportunistic); registered/limits then carry slot_page and slot_role.
FEATURE_SLOTS = "slots"
# register.features: the agent answers checkpoint (runs the job's checkpoint hooks at a boundary, trains on)
FEATURE_CHECKPOINT = "checkpoint"
# register.features: the agent keeps pinned host memory for a pause within limits.pin_bytes (pre-pins it)
FEATURE_PIN = "pin"
SLOT_ROLES = ("publish", "fill")
MAX_SLOT_PAGE_PATH = 255
# Absolute, no control characters (a NUL or a newline has no business in a path root made).
SLOT_PAGE_RE = re.compile(r"^/[^\x00-\x1f\x7f]*\Z")
MAX_JOB_GPUS = 64  # job_register's gpus bound; an elastic range lies within it


def _job_id(**kw: Any) -> Any:
    return _f(str, pattern=JOB_ID_RE, **kw)


def _bytes_(nullable: bool = False, **kw: Any) -> Any:
    return _f(int, ge=0, nullable=nullable, **kw)


def _text(**kw: Any) -> Any:
    return _f(str, max_len=kw.pop("max_len", 4096), **kw)


class Body:
    """Base of all message bodies. ``TYPE`` is the wire ``type``."""

    TYPE: ClassVar[str] = ""
    __slots__ = ()


_dc = dataclass(slots=True, kw_only=True)
