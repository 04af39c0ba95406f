"""Turning frames into messages and back: each body type's validator, compiled once from its field
declarations (hand-rolled rather than pydantic: an agent sends a report per training iteration), the
envelope, encode and decode."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .messages import (
    BODY_TYPES, Body, Error, GpuState, JobState, PreemptState, QueryCaller, QueryGpu, QueryJob, QueryNode, ReportGpu,
    ReportJob, ReportPreemptRequest,
)
from .spec import (
    _MISSING, ENVELOPE_KEYS, MARKER, MAX_ID_LEN, MAX_MESSAGE_BYTES, MAX_NUMBER, PROTOCOL_VERSION, ErrorCode,
    ProtocolError,
)


# ---------------------------------------------------------------------------------------------
# Validator compilation.

# Checkers take (value, where, name); the error path text is only built when raising, which keeps
# the per-report cost down.
Checker = Callable[[Any, str, str], Any]


def _bounds_text(m: dict) -> str:
    parts = []
    if m["gt"] is not None:
        parts.append(f"> {m['gt']}")
    if m["ge"] is not None:
        parts.append(f">= {m['ge']}")
    if m["le"] is not None:
        parts.append(f"<= {m['le']}")
    return " and ".join(parts)


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if name else where


def _jtype(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _scalar_checker(kind: Any, m: dict) -> Checker:
    if kind is int or kind is float:
        m = dict(m, le=MAX_NUMBER if m["le"] is None else m["le"])
        if m["ge"] is None and m["gt"] is None:
            m["ge"] = -MAX_NUMBER
    ge, gt, le = m["ge"], m["gt"], m["le"]
    choices, pattern, max_len = m["choices"], m["pattern"], m["max_len"]
    bounded = ge is not None or gt is not None or le is not None

    def bad_type(v: Any, where: str, name: str, want: str) -> ProtocolError:
        return ProtocolError(ErrorCode.bad_type, f"{_at(where, name)}: expected {want}, got {_jtype(v)}")

    def check_range(v: Any, where: str, name: str) -> None:
        if (ge is not None and v < ge) or (gt is not None and v <= gt) or (le is not None and v > le):
            shown = f"an integer of {v.bit_length()} bits" if type(v) is int and v.bit_length() > 64 else repr(v)
            raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: {shown} is out of range (must be {_bounds_text(m)})")

    if kind is int:
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not int:
                raise bad_type(v, where, name, "integer")
            if bounded:
                check_range(v, where, name)
            return v
    elif kind is float:
        def check(v: Any, where: str, name: str) -> Any:
            t = type(v)
            if t is not float and t is not int:
                raise bad_type(v, where, name, "number")
            v = float(v)
            if not math.isfinite(v):
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: {v!r} is not a finite number")
            if bounded:
                check_range(v, where, name)
            return v
    elif kind is bool:
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not bool:
                raise bad_type(v, where, name, "boolean")
            return v
    elif kind is str:
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not str:
                raise bad_type(v, where, name, "string")
            if choices is not None and v not in choices:
                raise ProtocolError(ErrorCode.bad_value,
                                    f"{_at(where, name)}: {v!r} is not allowed; allowed: {', '.join(sorted(choices))}")
            if pattern is not None and not pattern.match(v):
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: {v!r} does not match {pattern.pattern}")
            if max_len is not None and len(v) > max_len:
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: longer than {max_len} characters")
            return v
    elif dataclasses.is_dataclass(kind):
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not dict:
                raise bad_type(v, where, name, "object")
            return _build(kind, v, _at(where, name))
    elif kind is dict:
        # A free-form JSON object (an audit-log record): its shape is the audit log's, not the protocol's.
        def check(v: Any, where: str, name: str) -> Any:
            if type(v) is not dict:
                raise bad_type(v, where, name, "object")
            return v
    else:
        raise TypeError(f"unsupported field kind {kind!r}")
    return check


def _checker(kind: Any, m: dict) -> Checker:
    if getattr(kind, "__origin__", None) is list:
        (item_kind,) = kind.__args__
        item = _scalar_checker(item_kind, dict(m, nullable=False))

        def check_list(v: Any, where: str, name: str) -> Any:
            if type(v) is not list:
                raise ProtocolError(ErrorCode.bad_type, f"{_at(where, name)}: expected array, got {_jtype(v)}")
            if len(v) > 4096:
                raise ProtocolError(ErrorCode.bad_value, f"{_at(where, name)}: more than 4096 items")
            return [item(x, where, f"{name}[{i}]") for i, x in enumerate(v)]
        inner = check_list
    else:
        inner = _scalar_checker(kind, m)
    if not m["nullable"]:
        return inner

    def check_nullable(v: Any, where: str, name: str) -> Any:
        return None if v is None else inner(v, where, name)
    return check_nullable


@dataclass(frozen=True)
class _Spec:
    names: frozenset
    required: tuple
    fields: tuple  # (name, checker, default or _MISSING)
    omit: tuple = ()  # (name, default) of the fields left off the wire while they hold their default


_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        fields = []
        for fd in dataclasses.fields(cls):
            fields.append((fd.name, _checker(fd.metadata["kind"], fd.metadata), fd.default))
        omit = tuple((fd.name, fd.default) for fd in dataclasses.fields(cls) if fd.metadata.get("omit_default"))
        spec = _Spec(frozenset(n for n, _, _ in fields),
                     tuple(n for n, _, d in fields if d is _MISSING), tuple(fields), omit)
        _SPECS[cls] = spec
    return spec


def _build(cls: type, data: dict, where: str) -> Any:
    spec = _spec(cls)
    if len(data) != len(spec.names) or not spec.names.issuperset(data):
        extra = sorted(str(k) for k in data if k not in spec.names)
        if extra:
            raise ProtocolError(ErrorCode.extra_field,
                                f"{where}: unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(spec.names))}")
    kwargs = {}
    for name, check, default in spec.fields:
        if name in data:
            kwargs[name] = check(data[name], where, name)
        elif default is _MISSING:
            raise ProtocolError(ErrorCode.missing_field, f"{where}: missing field {name!r}")
        else:
            kwargs[name] = default
    try:
        return cls(**kwargs)
    except ValueError as e:  # a rule across fields (__post_init__), which no single checker can see
        raise ProtocolError(ErrorCode.bad_value, f"{where}: {e}") from None


for _cls in (*BODY_TYPES.values(), GpuState, JobState, PreemptState, ReportGpu, ReportJob, ReportPreemptRequest,
             QueryCaller, QueryJob, QueryGpu, QueryNode):
    _spec(_cls)


# ---------------------------------------------------------------------------------------------
# Envelope.

_id_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}"
_id_counter = itertools.count(1)


def new_id() -> str:
    """A message id unique to this process for its lifetime (cheaper than a uuid per report)."""
    return f"{_id_prefix}-{next(_id_counter)}"


@dataclass(slots=True)
class Message:
    body: Body
    id: str = field(default_factory=new_id)
    ref: Optional[str] = None
    ts: float = field(default_factory=time.time)
    v: int = PROTOCOL_VERSION

    @property
    def type(self) -> str:
        return self.body.TYPE


def message(body: Body, ref: Optional[str] = None) -> Message:
    return Message(body=body, ref=ref)


def reply(to: Message, body: Body) -> Message:
    return Message(body=body, ref=to.id)


def error_message(code: ErrorCode, text: str, ref: Optional[str] = None) -> Message:
    return Message(body=Error(code=ErrorCode(code).value, message=text[:4096]), ref=ref)


def _to_wire(obj: Any) -> Any:
    if type(obj) is list or type(obj) is tuple:
        return [_to_wire(x) for x in obj]
    spec = _SPECS.get(type(obj))
    if spec is not None:
        out = {name: _to_wire(getattr(obj, name)) for name, _, _ in spec.fields}
        for name, default in spec.omit:
            if out[name] == default:
                del out[name]
        return out
    return obj


def body_dict(body: Body) -> dict:
    return _to_wire(body)


def encode(msg: Message) -> list[bytes]:
    """Frames for ``msg`` (marker + JSON). Validates the body so a sender bug fails at the sender."""
    body = msg.body
    cls = type(body)
    if BODY_TYPES.get(getattr(cls, "TYPE", None)) is not cls:
        raise ProtocolError(ErrorCode.unknown_type, f"{cls.__name__} is not a protocol message body")
    data = _to_wire(body)
    _build(cls, data, cls.TYPE)
    env = {"v": msg.v, "type": cls.TYPE, "id": msg.id, "ts": msg.ts, "ref": msg.ref, "body": data}
    try:
        raw = json.dumps(env, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise ProtocolError(ErrorCode.bad_value, f"{cls.TYPE}: cannot encode: {e}") from None
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.too_large, f"{cls.TYPE}: {len(raw)} bytes > {MAX_MESSAGE_BYTES}")
    return [MARKER, raw]


def decode(frames: list, accept: Optional[frozenset] = None) -> Message:
    """The message in ``frames`` (routing identities already stripped), or a :class:`ProtocolError`.

    ``accept`` limits the types this receiver takes (e.g. :data:`AGENT_TO_SIDECAR`); another valid
    type raises ``wrong_direction``.
    """
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.bad_frames,
                            f"expected 2 frames (marker, JSON envelope), got {len(frames)}")
    marker, raw = frames
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raw = getattr(raw, "bytes", raw)
    if bytes(getattr(marker, "bytes", marker)) != MARKER:
        raise ProtocolError(ErrorCode.bad_frames, f"first frame must be {MARKER!r}")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.too_large, f"message of {len(raw)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        env = json.loads(raw)
    except RecursionError:
        raise ProtocolError(ErrorCode.bad_json, "envelope is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(ErrorCode.bad_json, f"envelope is not valid UTF-8 JSON: {e}") from None
    if type(env) is not dict:
        raise ProtocolError(ErrorCode.bad_envelope, f"envelope must be a JSON object, got {_jtype(env)}")
    mid = env.get("id")
    ref = mid if type(mid) is str and 0 < len(mid) <= MAX_ID_LEN else None
    v = env.get("v")
    if type(v) is not int:
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'v' (protocol major version) must be an integer"
                            if "v" in env else "envelope has no 'v' (protocol major version)", ref)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.version_mismatch,
                            f"peer speaks antman protocol v{v}, this side speaks v{PROTOCOL_VERSION}",
                            ref, peer_version=v)
    if len(env) != len(ENVELOPE_KEYS) or not ENVELOPE_KEYS.issuperset(env):
        missing = sorted(ENVELOPE_KEYS.difference(env))
        if missing:
            raise ProtocolError(ErrorCode.missing_field, f"envelope: missing field(s) {', '.join(missing)}", ref)
        extra = sorted(str(k) for k in env if k not in ENVELOPE_KEYS)
        raise ProtocolError(ErrorCode.extra_field, f"envelope: unknown field(s) {', '.join(extra)}", ref)
    if ref is None:
        raise ProtocolError(ErrorCode.bad_envelope,
                            f"envelope field 'id' must be a non-empty string of at most {MAX_ID_LEN} characters")
    mtype, ts, mref, body = env["type"], env["ts"], env["ref"], env["body"]
    if type(mtype) is not str:
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'type' must be a string", ref)
    if (type(ts) is not float and type(ts) is not int) or not math.isfinite(ts):
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'ts' must be a finite number", ref)
    if mref is not None and (type(mref) is not str or len(mref) > MAX_ID_LEN):
        raise ProtocolError(ErrorCode.bad_envelope, "envelope field 'ref' must be null or a message id", ref)
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.bad_envelope, f"envelope field 'body' must be an object, got {_jtype(body)}", ref)
    cls = BODY_TYPES.get(mtype)
    if cls is None:
        raise ProtocolError(ErrorCode.unknown_type,
                            f"unknown message type {mtype[:64]!r}; known: {', '.join(sorted(BODY_TYPES))}", ref)
    if accept is not None and mtype not in accept:
        raise ProtocolError(ErrorCode.wrong_direction,
                            f"{mtype!r} is not accepted here; accepted: {', '.join(sorted(accept))}", ref)
    try:
        parsed = _build(cls, body, mtype)
    except ProtocolError as e:
        e.ref = ref
        raise
    return Message(body=parsed, id=mid, ref=mref, ts=float(ts), v=v)


def query_payload(msg_id: str, body: Body) -> bytes:
    """What a query request's munge credential carries: the request itself, its credential left out,
    as canonical JSON. The coordinator recomputes it from the message it got and compares."""
    data = {k: v for k, v in _to_wire(body).items() if k != "credential"}
    doc = {"v": PROTOCOL_VERSION, "type": body.TYPE, "id": msg_id, "body": data}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
