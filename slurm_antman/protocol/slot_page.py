"""The idle-slot page: a guaranteed job's GPU phases, published for its GPU's opportunistic jobs in
shared memory (docs/protocol.md, "The idle-slot page").

AntMan's GpuOpManager hands a guaranteed job's idle time slots to opportunistic work (OSDI'20, §4.2).
For an opportunistic job to launch only into those slots it must learn, well inside a millisecond,
when the guaranteed job's device work drained and when its next burst began. A ZeroMQ round trip is
about 0.3 ms here (docs/benchmarks.md, control path), as long as the phases it would report, so the
guaranteed job's agent writes its phase into a page of memory instead, and readers poll it.

**Layout.** One 4096-byte file (a page), of which the first 64 bytes are eight little-endian unsigned
64-bit words, each aligned to 8 bytes:

====  ==============  ===================================================================================
word  name            meaning
====  ==============  ===================================================================================
0     magic           ``MAGIC`` (b"ANTSLOT1"): the file is a page of this version
1     seq             the seqlock's counter: odd while the writer is changing words 2-7
2     state           ``NONE`` 0 (no guaranteed job publishes), ``IDLE`` 1 (its work drained),
                      ``BUSY`` 2 (its work is in flight)
3     since_ns        ``CLOCK_MONOTONIC`` (``time.monotonic_ns``, one clock for the machine) when the
                      state began
4     idle_mean_ns    the mean length of its idle periods (exponentially weighted, ``EWMA``)
5     busy_mean_ns    the mean length of its busy periods (same)
6     periods         busy periods completed since the page was set up
7     writer_pid      the publishing process (informational: a reader never acts on it)
====  ==============  ===================================================================================

**Seqlock.** The writer makes ``seq`` odd, writes words 2-7, and makes ``seq`` even again (one writer
per page: the guaranteed job's agent; the sidecar sets the page up before and resets it after). A
reader reads ``seq``, the words and ``seq`` again, and keeps the words only if both reads were equal
and even; else it retries, a bounded number of times. On x86-64 aligned 8-byte stores and loads are
single instructions and stores are seen in program order (TSO), which is all the seqlock needs; a
weakly ordered CPU would need fences, which Python cannot issue (not supported there: ``check_platform``).

Every word is stored and loaded whole, through a ``memoryview`` cast to native ``Q`` (one 8-byte
``memcpy``: one ``mov``). Never through ``struct.pack_into``: it zeroes its whole field first and
then writes byte by byte, so a reader could see ``seq`` as 0 (even) at the start and at the end of
one write and keep a half-written body (CI found this: a snapshot with words 2-4 new and 5-7 zero).

**Trust.** The page is written by a job, so a reader treats every word as a claim: a state it does not
know, a time in the future or a mean past ``MAX_PERIOD_NS`` makes the snapshot invalid, and a reader
that sees only invalid or torn snapshots falls back to its duty throttle. Root never reads it (the
sidecar's checks come from measured slowdown, as before).
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import time
from dataclasses import dataclass
from typing import Optional

PAGE_BYTES = 4096
MAGIC = int.from_bytes(b"ANTSLOT1", "little")
NONE, IDLE, BUSY = 0, 1, 2
STATE_NAMES = {NONE: "none", IDLE: "idle", BUSY: "busy"}
_WORDS = struct.Struct("<8Q")  # only to write a page nobody has mapped yet (init_page)
_SEQ, _BODY = 1, slice(2, 8)
# A period longer than this (an hour) is a lie or a hang, not a phase.
MAX_PERIOD_NS = 3600 * 10**9
# Weight of a new period in the means: a few iterations' worth of memory, so a phase change of the
# guaranteed job (evaluation, a new batch size) is followed within a second or two.
EWMA = 0.25
READ_TRIES = 16


class SlotPageError(ValueError):
    pass


def check_platform() -> Optional[str]:
    """Why this machine cannot use the page (None: it can)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the idle-slot page needs x86-64's store order; this machine is {platform.machine()}"
    return None


@dataclass(frozen=True)
class Snapshot:
    state: int
    since_ns: int
    idle_mean_ns: int
    busy_mean_ns: int
    periods: int
    writer_pid: int

    def stale(self, now_ns: int) -> bool:
        """A state held far longer than its phases last: the writer hung, died or lies. Readers then
        fall back to the duty throttle."""
        held = now_ns - self.since_ns
        mean = self.busy_mean_ns if self.state == BUSY else self.idle_mean_ns
        return self.state == NONE or held > 8 * mean + 10**9


def init_page(fd: int) -> None:
    """Size a new page file (by its descriptor) and write an empty page: state NONE, seq 0."""
    os.ftruncate(fd, PAGE_BYTES)
    os.pwrite(fd, _WORDS.pack(MAGIC, 0, NONE, 0, 0, 0, 0, 0), 0)


def create(path: str) -> None:
    """A new empty page at ``path`` (never over an existing file, never through a link), for a
    benchmark or a test; the sidecar makes its own through its directory's descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        init_page(fd)
    finally:
        os.close(fd)


def _open_map(path: str, writable: bool) -> tuple[mmap.mmap, memoryview]:
    """The page mapped, and its eight words as a view whose items are loaded and stored whole."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise SlotPageError(f"idle-slot page {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if st.st_size != PAGE_BYTES:
            raise SlotPageError(f"idle-slot page {path}: {st.st_size} bytes, expected {PAGE_BYTES}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        m = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    words = memoryview(m).cast("Q")
    if words[0] != MAGIC:
        words.release()
        m.close()
        raise SlotPageError(f"idle-slot page {path}: not a page of this version (bad magic)")
    return m, words


class SlotWriter:
    """The guaranteed job's side: ``busy()`` when its first device work of a burst is launched,
    ``idle()`` when all of it has drained. Cheap (a few struct writes), never blocks."""

    def __init__(self, path: str, clock=time.monotonic_ns) -> None:
        self._m, self._w = _open_map(path, writable=True)
        self._clock = clock
        self._state = NONE
        self._since = 0
        self._idle_mean = 0
        self._busy_mean = 0
        self._periods = 0
        self._pid = os.getpid()
        self._seq = self._w[_SEQ] & ~1
        self._publish()

    def _publish(self) -> None:
        w = self._w
        self._seq += 1
        w[_SEQ] = self._seq
        w[2] = self._state
        w[3] = self._since
        w[4] = self._idle_mean
        w[5] = self._busy_mean
        w[6] = self._periods
        w[7] = self._pid
        self._seq += 1
        w[_SEQ] = self._seq

    @staticmethod
    def _mean(old: int, new: int) -> int:
        # Clamped both ways: a clock handed in by a caller that went back must not stop the page (a
        # negative word cannot be stored, and a write that raised half-way would leave it torn).
        new = max(0, min(new, MAX_PERIOD_NS))
        return new if old == 0 else int(old + EWMA * (new - old))

    def busy(self, now_ns: Optional[int] = None) -> None:
        if self._state == BUSY:
            return
        now = self._clock() if now_ns is None else now_ns
        if self._state == IDLE:
            self._idle_mean = self._mean(self._idle_mean, now - self._since)
        self._state, self._since = BUSY, now
        self._publish()

    def idle(self, now_ns: Optional[int] = None) -> None:
        if self._state == IDLE:
            return
        now = self._clock() if now_ns is None else now_ns
        if self._state == BUSY:
            self._busy_mean = self._mean(self._busy_mean, now - self._since)
            self._periods += 1
        self._state, self._since = IDLE, now
        self._publish()

    @property
    def periods(self) -> int:
        """Busy periods completed since this writer opened the page."""
        return self._periods

    def close(self, state: int = NONE) -> None:
        """Leave the page saying nobody publishes (the job ends or stops being guaranteed here)."""
        if self._m.closed:
            return
        self._state, self._since = state, self._clock()
        self._publish()
        self._w.release()
        self._m.close()


class SlotReader:
    """An opportunistic job's side: ``read()`` a consistent snapshot, or None when the page says
    nothing it can trust (torn every time, or implausible)."""

    def __init__(self, path: str, clock=time.monotonic_ns) -> None:
        self._m, self._w = _open_map(path, writable=False)
        self._clock = clock
        self.torn = 0
        self.invalid = 0

    def read(self) -> Optional[Snapshot]:
        w = self._w
        for _ in range(READ_TRIES):
            s1 = w[_SEQ]
            if s1 & 1:
                continue
            body = w[_BODY].tolist()
            if w[_SEQ] == s1:
                snap = Snapshot(*body)
                if not self._plausible(snap):
                    self.invalid += 1
                    return None
                return snap
        self.torn += 1
        return None

    def _plausible(self, s: Snapshot) -> bool:
        return (s.state in STATE_NAMES and s.since_ns <= self._clock() + 10**6
                and s.idle_mean_ns <= MAX_PERIOD_NS and s.busy_mean_ns <= MAX_PERIOD_NS)

    def close(self) -> None:
        if not self._m.closed:
            self._w.release()
            self._m.close()


def may_launch(snap: Optional[Snapshot], now_ns: int, work_ns: int, margin: float = 0.8) -> Optional[bool]:
    """Whether an opportunistic job may launch ``work_ns`` of device work now (the slot-filling gate):
    True when the guaranteed job is idle and the work ends, by its mean idle period, before
    ``margin`` of that period is over; False when it is busy, or the slot is too short or nearly over;
    None when the page tells nothing (no snapshot, nobody publishing, or stale): the caller falls back
    to its duty throttle. Pure."""
    if snap is None or snap.stale(now_ns):
        return None
    if snap.state != IDLE:
        return False
    if snap.idle_mean_ns <= 0:
        return False  # no idle period measured yet: nothing known to fill
    return (now_ns - snap.since_ns) + work_ns <= margin * snap.idle_mean_ns
