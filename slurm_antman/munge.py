"""MUNGE credentials, as Slurm authenticates its own RPCs: libmunge (``libmunge.so.2``) through ctypes.

A credential is made by the local munged for the calling process's uid and gid (munged reads them from
the kernel, off its socket's peer credentials), carries a payload, and can be decoded once, within
its time-to-live, by any munged sharing the key. So the decoding side learns who made it without
trusting anything the client states, and a captured credential cannot be used twice.

libmunge rather than the ``munge``/``unmunge`` commands: no process per request in the coordinator,
and munged's own error numbers (expired, replayed, ...) instead of parsing text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass
from typing import Optional

from .errors import AntmanError

# munge.h: munge_opt_t and munge_err_t (stable since MUNGE 0.5).
_OPT_TTL = 4
_OPT_SOCKET = 8

EMUNGE_SNAFU = 1
EMUNGE_NO_MEMORY = 5
EMUNGE_SOCKET = 6
EMUNGE_TIMEOUT = 7
EMUNGE_CRED_EXPIRED = 15
EMUNGE_CRED_REWOUND = 16
EMUNGE_CRED_REPLAYED = 17

# Far above what a query needs; libmunge's own limit is larger, this keeps a peer from making the
# decoder allocate much.
MAX_CREDENTIAL_CHARS = 8192


class MungeError(AntmanError):
    """A credential could not be made or checked. ``code`` is munged's error number (0 when none)."""

    def __init__(self, message: str, code: int = 0):
        self.code = code
        super().__init__(message)


class MungeUnavailable(MungeError):
    """No libmunge on this host, or munged does not answer: nothing can be made or checked here."""


class CredentialError(MungeError):
    """The credential itself is refused: malformed, forged, or made with another key."""


class CredentialExpired(CredentialError):
    """Older than its time-to-live (or made in the future: clocks too far apart)."""


class CredentialReplayed(CredentialError):
    """Already decoded once: munged keeps every credential it decoded until it expires."""


@dataclass(frozen=True)
class Credential:
    """What munged vouches for: the uid and gid of the process that made the credential, and its payload."""

    uid: int
    gid: int
    payload: bytes


_lib: Optional[ctypes.CDLL] = None
_libc: Optional[ctypes.CDLL] = None
_load_lock = threading.Lock()


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    global _lib, _libc
    with _load_lock:
        if _lib is None:
            name = ctypes.util.find_library("munge") or "libmunge.so.2"
            try:
                lib = ctypes.CDLL(name)
            except OSError as e:
                raise MungeUnavailable(f"libmunge is not installed on this host ({e}); install the munge "
                                       "package, as Slurm itself needs it") from None
            lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int]
            lib.munge_encode.restype = ctypes.c_int
            lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint32),
                                         ctypes.POINTER(ctypes.c_uint32)]
            lib.munge_decode.restype = ctypes.c_int
            lib.munge_strerror.argtypes = [ctypes.c_int]
            lib.munge_strerror.restype = ctypes.c_char_p
            lib.munge_ctx_create.argtypes = []
            lib.munge_ctx_create.restype = ctypes.c_void_p
            lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
            lib.munge_ctx_destroy.restype = None
            lib.munge_ctx_strerror.argtypes = [ctypes.c_void_p]
            lib.munge_ctx_strerror.restype = ctypes.c_char_p
            # munge_ctx_set is variadic: its argtypes stay unset and each call passes typed values.
            lib.munge_ctx_set.restype = ctypes.c_int
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.free.argtypes = [ctypes.c_void_p]
            libc.free.restype = None
            _lib, _libc = lib, libc
    assert _lib is not None and _libc is not None
    return _lib, _libc


class _Ctx:
    """One munge context per call: libmunge contexts must not be shared between threads."""

    def __init__(self, lib: ctypes.CDLL, socket: Optional[str], ttl: Optional[int]):
        self.lib = lib
        self.ptr = lib.munge_ctx_create()
        if not self.ptr:
            raise MungeError("libmunge could not create a context (out of memory?)")
        try:
            if socket is not None:
                self._set(_OPT_SOCKET, ctypes.c_char_p(socket.encode()))
            if ttl is not None:
                self._set(_OPT_TTL, ctypes.c_int(ttl))
        except MungeError:
            self.close()
            raise

    def _set(self, opt: int, value: object) -> None:
        err = self.lib.munge_ctx_set(ctypes.c_void_p(self.ptr), ctypes.c_int(opt), value)
        if err:
            raise MungeError(f"libmunge refused option {opt}: {self.lib.munge_strerror(err).decode()}", err)

    def error(self, err: int) -> str:
        detail = self.lib.munge_ctx_strerror(ctypes.c_void_p(self.ptr))
        return (detail or self.lib.munge_strerror(err) or b"unknown error").decode(errors="replace")

    def close(self) -> None:
        if self.ptr:
            self.lib.munge_ctx_destroy(ctypes.c_void_p(self.ptr))
            self.ptr = None


def _raise(err: int, text: str, doing: str) -> None:
    if err in (EMUNGE_SOCKET, EMUNGE_TIMEOUT):
        raise MungeUnavailable(f"munged does not answer ({text}): is munged running on this host?", err)
    if err in (EMUNGE_CRED_EXPIRED, EMUNGE_CRED_REWOUND):
        raise CredentialExpired(f"munge {doing}: {text}", err)
    if err == EMUNGE_CRED_REPLAYED:
        raise CredentialReplayed(f"munge {doing}: {text}", err)
    if doing == "decode" and err not in (EMUNGE_SNAFU, EMUNGE_NO_MEMORY):  # the rest: the credential's fault
        raise CredentialError(f"munge {doing}: {text}", err)
    raise MungeError(f"munge {doing}: {text}", err)


def encode(payload: bytes = b"", ttl: Optional[int] = None, socket: Optional[str] = None) -> str:
    """A credential for the calling process's uid/gid carrying ``payload``. ``ttl``: seconds (munged's
    default when None); ``socket``: munged's socket (libmunge's default when None)."""
    lib, libc = _load()
    ctx = _Ctx(lib, socket, ttl)
    try:
        out = ctypes.c_char_p()
        buf = ctypes.create_string_buffer(payload, len(payload))
        err = lib.munge_encode(ctypes.byref(out), ctypes.c_void_p(ctx.ptr), buf, len(payload))
        if err:
            _raise(err, ctx.error(err), "encode")
        try:
            return (out.value or b"").decode("ascii")
        finally:
            libc.free(ctypes.cast(out, ctypes.c_void_p))
    finally:
        ctx.close()


def decode(credential: str, socket: Optional[str] = None) -> Credential:
    """Who made ``credential`` and its payload, as munged vouches; one of the typed errors otherwise.
    munged refuses a credential it has decoded before (CredentialReplayed)."""
    if not credential or len(credential) > MAX_CREDENTIAL_CHARS or not credential.isascii() or "\0" in credential:
        raise CredentialError("not a munge credential (empty, too long, or not ASCII)")
    lib, libc = _load()
    ctx = _Ctx(lib, socket, None)
    buf = ctypes.c_void_p()
    length = ctypes.c_int(0)
    uid = ctypes.c_uint32(0)
    gid = ctypes.c_uint32(0)
    try:
        err = lib.munge_decode(credential.encode("ascii"), ctypes.c_void_p(ctx.ptr), ctypes.byref(buf),
                               ctypes.byref(length), ctypes.byref(uid), ctypes.byref(gid))
        payload = ctypes.string_at(buf, length.value) if buf.value and length.value > 0 else b""
        if err:
            _raise(err, ctx.error(err), "decode")
        return Credential(uid=int(uid.value), gid=int(gid.value), payload=payload)
    finally:
        if buf.value:
            libc.free(buf)  # allocated for some errors too (expired, replayed)
        ctx.close()
