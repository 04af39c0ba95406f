"""The device side of the contending emulated GPU (``contended_gpu`` has the design, the job's side
and the protocol): the FIFO core in virtual time (:class:`DeviceCore`), the per-GPU server that runs it
on a Unix socket (:class:`DeviceServer`, :func:`serve`) and its command line,
``python -m slurm_antman.lab.evaluation.contended_device serve``, which jobs start on demand."""

from __future__ import annotations

import argparse
import collections
import fcntl
import math
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .contended_gpu import (
    _HELLO_RE, _KERNEL_RE, _MAX_LAUNCH_AGE_S, _PRECISE_S, DEFAULT_IDLE_S, DEFAULT_SWITCH_S, LINE_MAX, LOCK_NAME,
    LOCK_WAIT_S, LOG_NAME, MAX_CLIENTS, MAX_KERNEL_S, MAX_QUEUED, PROTOCOL_VERSION, SOCK_NAME, _Address, gpu_dir,
)
from .emulated_gpu import BoardError


# --- the device's core: a FIFO of kernels, in virtual time ------------------------------------------


@dataclass
class Kernel:
    owner: int
    seq: int
    dur: float
    submitted: float
    start: float = math.nan
    end: float = math.nan
    switched: bool = False  # a context switch was charged before it


@dataclass
class DeviceCore:
    """What the device does, without I/O: ``submit`` kernels, ``advance`` to now (the kernels that
    finished by then, each started when the device was free and its turn came), ``drop`` a job's queued
    kernels. Times are seconds of one monotonic clock."""

    switch_s: float = DEFAULT_SWITCH_S
    queue: collections.deque = field(default_factory=collections.deque)
    running: Optional[Kernel] = None
    last_owner: Optional[int] = None
    free_at: float = -math.inf
    busy_s: float = 0.0
    switches: int = 0
    done_kernels: int = 0

    def submit(self, owner: int, seq: int, dur: float, now: float) -> None:
        self.queue.append(Kernel(owner, seq, dur, now))
        if self.running is None:
            self._start_next()

    def _start_next(self) -> None:
        if not self.queue:
            self.running = None
            return
        k = self.queue.popleft()
        t = max(self.free_at, k.submitted)
        if self.last_owner is not None and k.owner != self.last_owner:
            t += self.switch_s
            k.switched = True
            self.switches += 1
        k.start, k.end = t, t + k.dur
        self.running, self.last_owner = k, k.owner

    def advance(self, now: float) -> list[Kernel]:
        done = []
        while self.running is not None and self.running.end <= now:
            k = self.running
            done.append(k)
            self.free_at = k.end
            self.busy_s += k.dur
            self.done_kernels += 1
            self._start_next()
        return done

    def deadline(self) -> Optional[float]:
        return None if self.running is None else self.running.end

    def drop(self, owner: int) -> int:
        """Forgets ``owner``'s queued kernels (its running one, if any, runs to its end)."""
        before = len(self.queue)
        self.queue = collections.deque(k for k in self.queue if k.owner != owner)
        return before - len(self.queue)

    @property
    def idle(self) -> bool:
        return self.running is None and not self.queue


def _take_lock(directory: str, wait_s: float) -> Optional[int]:
    """The device's lock for this GPU, or None if another device holds it for ``wait_s``."""
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.02)


# --- the device server ------------------------------------------------------------------------------


class _Conn:
    __slots__ = ("ident", "sock", "buf", "name", "queued")

    def __init__(self, ident: int, sock: socket.socket) -> None:
        self.ident, self.sock, self.buf, self.name, self.queued = ident, sock, bytearray(), None, 0


class _Stop(BaseException):
    pass


class DeviceServer:
    """One GPU's device (module doc). ``run`` returns when idle for ``idle_s`` or on SIGTERM/SIGINT."""

    def __init__(self, directory: str, switch_s: float = DEFAULT_SWITCH_S, idle_s: float = DEFAULT_IDLE_S,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.dir = directory
        self.core = DeviceCore(switch_s)
        self.idle_s = idle_s
        self._log = log or (lambda s: None)
        self.conns: dict[int, _Conn] = {}
        self._next_ident = 0
        self._sel = selectors.DefaultSelector()
        self._listener: Optional[socket.socket] = None
        self._ino: Optional[int] = None
        self._batch: list[tuple[float, int, _Conn, int, float]] = []  # read this wake-up, not yet queued
        self.refused = 0

    def log(self, msg: str) -> None:
        self._log(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} device pid {os.getpid()} {self.dir}: {msg}")

    def bind(self) -> None:
        """Binds the socket (the caller holds the lock, so a socket file already there is stale)."""
        with _Address(self.dir) as a:
            try:
                os.unlink(a.path)
            except FileNotFoundError:
                pass
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o077)  # only this user's jobs may connect
            try:
                s.bind(a.addr)
            finally:
                os.umask(old)
            self._ino = os.stat(a.path).st_ino
        s.listen(64)
        s.setblocking(False)
        self._listener = s
        self._sel.register(s, selectors.EVENT_READ, None)

    def run(self) -> None:
        idle_since: Optional[float] = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                deadline = self.core.deadline()
                if deadline is not None:
                    # select's timeout is rounded up to whole milliseconds: wait there until ~1.5 ms
                    # before the kernel is due, then the rest in one precise sleep, so that a job
                    # waiting for the device hears of its kernel ~0.1 ms after it ended, not ~1 ms.
                    remaining = deadline - now
                    if remaining > _PRECISE_S:
                        timeout: Optional[float] = remaining - _PRECISE_S
                    else:
                        if remaining > 0:
                            time.sleep(remaining)
                        timeout = 0.0
                elif idle_since is not None:
                    timeout = max(0.0, idle_since + self.idle_s - now)
                else:
                    timeout = None
                for key, _ in self._sel.select(timeout):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                self._queue_batch()
                now = time.monotonic()
                for k in self.core.advance(now):
                    c = self.conns.get(k.owner)
                    if c is not None:
                        c.queued -= 1
                        self._send(c, b"d %d %d %d\n" % (k.seq, int(k.start * 1e9), int(k.end * 1e9)))
                if self.conns or not self.core.idle:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= self.idle_s:
                    self.log(f"idle for {self.idle_s:g} s: exiting ({self.core.done_kernels} kernels, "
                             f"{self.core.busy_s:.1f} s busy, {self.core.switches} switches)")
                    return
        except _Stop:
            self.log("stopped by a signal")

    def close(self) -> None:
        """Removes the socket file if it is still this device's, closes everything."""
        if self._listener is not None:
            path = os.path.join(self.dir, SOCK_NAME)
            try:
                if os.stat(path).st_ino == self._ino:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            self._listener.close()
            self._listener = None
        for c in list(self.conns.values()):
            c.sock.close()
        self.conns.clear()
        self._sel.close()

    # --- connections ---

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: refuse this one, keep serving
                self.log(f"accept failed: {e}")
                return
            sock.setblocking(False)
            c = _Conn(self._next_ident, sock)
            self._next_ident += 1
            self.conns[c.ident] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
            if len(self.conns) > MAX_CLIENTS:
                self._refuse(c, f"more than {MAX_CLIENTS} jobs on this device")

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c, "closed")
            return
        c.buf += data
        now = time.monotonic()
        while c.ident in self.conns:
            nl = c.buf.find(b"\n")
            if nl < 0:
                if len(c.buf) > LINE_MAX:
                    self._refuse(c, f"a line longer than {LINE_MAX} bytes")
                return
            line = bytes(c.buf[:nl])
            del c.buf[:nl + 1]
            self._request(c, line, now)

    def _request(self, c: _Conn, line: bytes, now: float) -> None:
        if len(line) > LINE_MAX:
            self._refuse(c, f"a line longer than {LINE_MAX} bytes")
            return
        if c.name is None:
            m = _HELLO_RE.fullmatch(line)
            if m is None:
                self._refuse(c, f"expected 'hello <name>' first, got {line[:40]!r}")
                return
            c.name = m.group(1).decode()
            self._send(c, b"ok %d %d %d\n" % (PROTOCOL_VERSION, round(self.core.switch_s * 1e6), os.getpid()))
            return
        m = _KERNEL_RE.fullmatch(line)
        if m is None:
            self._refuse(c, f"not a request: {line[:40]!r}")
            return
        us = int(m.group(2))
        if not 0 < us <= MAX_KERNEL_S * 1e6:
            self._refuse(c, f"kernel of {us} us: allowed 1 to {int(MAX_KERNEL_S * 1e6)}")
            return
        if c.queued >= MAX_QUEUED:
            self._refuse(c, f"more than {MAX_QUEUED} unfinished kernels")
            return
        c.queued += 1
        launched = min(now, max(now - _MAX_LAUNCH_AGE_S, int(m.group(3)) / 1e9))
        self._batch.append((launched, len(self._batch), c, int(m.group(1)), us / 1e6))

    def _queue_batch(self) -> None:
        """Queues the kernels read in this wake-up, in the order they were launched."""
        batch, self._batch = sorted(self._batch, key=lambda b: b[:2]), []
        for launched, _, c, seq, dur in batch:
            if c.ident in self.conns:  # not refused or gone meanwhile
                self.core.submit(c.ident, seq, dur, launched)

    def _send(self, c: _Conn, data: bytes) -> None:
        try:
            sent = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(c, "gone while answering")
            return
        if sent != len(data):
            # Completions are short lines bounded by MAX_QUEUED: only a job that stopped reading fills
            # its socket buffer. The device must never wait for one job.
            self._drop(c, "not reading its completions")

    def _refuse(self, c: _Conn, reason: str) -> None:
        self.refused += 1
        self.log(f"refused job {c.name or '?'} (connection {c.ident}): {reason}")
        try:
            c.sock.send(b"err " + reason.encode("ascii", "replace")[:LINE_MAX - 5] + b"\n")
        except OSError:
            pass
        self._drop(c, "refused")

    def _drop(self, c: _Conn, why: str) -> None:
        if self.conns.pop(c.ident, None) is None:
            return
        dropped = self.core.drop(c.ident)
        if dropped:
            self.log(f"job {c.name or '?'} (connection {c.ident}) {why}: {dropped} queued kernels dropped")
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()


def serve(root: str, node: str, gpu: int, switch_s: float = DEFAULT_SWITCH_S, idle_s: float = DEFAULT_IDLE_S,
          lock_wait_s: float = LOCK_WAIT_S) -> int:
    """Runs the device of one GPU unless one runs already. 0 in both cases; 2 on bad arguments."""
    try:
        d = gpu_dir(root, node, gpu)
    except BoardError as e:
        sys.stderr.write(f"contended_gpu serve: {e}\n")
        return 2
    os.makedirs(d, exist_ok=True)
    log_fd = os.open(os.path.join(d, LOG_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def log(msg: str) -> None:
        try:
            os.write(log_fd, (msg + "\n").encode())
        except OSError:
            pass

    lock = _take_lock(d, lock_wait_s)
    if lock is None:
        os.close(log_fd)
        return 0  # another device runs for this GPU
    server = DeviceServer(d, switch_s, idle_s, log)

    def stop(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.bind()
        server.log(f"serving (switch {switch_s * 1e3:g} ms, idle exit {idle_s:g} s)")
        server.run()
    except _Stop:
        server.log("stopped by a signal")
    except Exception:
        server.log("failed:\n" + traceback.format_exc())
        return 1
    finally:
        server.close()  # the socket goes before the lock: a device started next binds afresh
        os.close(lock)
        os.close(log_fd)
    return 0


# --- command line -------------------------------------------------------------------------------------


def _daemonise() -> None:
    """Fork once: the parent (what the spawning job waits for) returns at once, the child serves on,
    in its own session, without a controlling terminal."""
    if os.fork() > 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_antman.lab.evaluation.contended_device",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run one emulated GPU's device (jobs start it on demand)")
    s.add_argument("--root", required=True, help="the emulated GPUs' board directory")
    s.add_argument("--node", required=True, help="the node's name (a directory under --root)")
    s.add_argument("--gpu", type=int, required=True, help="the GPU's index on the node")
    s.add_argument("--switch-ms", type=float, default=DEFAULT_SWITCH_S * 1e3,
                   help="context-switch cost in ms (default %(default)s: assumed, see the module doc)")
    s.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S, help="exit after this long with no job")
    s.add_argument("--daemon", action="store_true", help="fork into the background first")
    a = p.parse_args(argv)
    if not (math.isfinite(a.switch_ms) and 0 <= a.switch_ms <= MAX_KERNEL_S * 1e3):
        p.error(f"--switch-ms must be in [0, {MAX_KERNEL_S * 1e3:g}], got {a.switch_ms}")
    if not (math.isfinite(a.idle_s) and a.idle_s > 0):
        p.error(f"--idle-s must be a number > 0, got {a.idle_s}")
    if a.daemon:
        _daemonise()
    return serve(a.root, a.node, a.gpu, a.switch_ms / 1e3, a.idle_s)


if __name__ == "__main__":
    sys.exit(main())
