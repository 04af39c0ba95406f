"""The idle-slot page (slurm_antman/protocol/slot_page.py): layout, seqlock, the gate, hostile pages."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct

import pytest

from slurm_antman.protocol import slot_page as sp

MS = 10**6


def _page(tmp_path, name="gpu0.slots") -> str:
    path = str(tmp_path / name)
    sp.create(path)
    return path


class Clock:
    def __init__(self, t: int = 10**12) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def test_layout_is_eight_aligned_words_and_an_empty_page_says_nobody_publishes(tmp_path):
    path = _page(tmp_path)
    raw = open(path, "rb").read()
    assert len(raw) == sp.PAGE_BYTES
    words = struct.unpack_from("<8Q", raw)
    assert raw[:8] == b"ANTSLOT1" and words[1] == 0 and words[2] == sp.NONE
    snap = sp.SlotReader(path).read()
    assert snap is not None and snap.state == sp.NONE
    assert sp.may_launch(snap, 10**12, MS) is None  # nothing known: the duty throttle decides


def test_writer_phases_and_means_as_a_reader_sees_them(tmp_path):
    path = _page(tmp_path)
    clk = Clock()
    w, r = sp.SlotWriter(path, clock=clk), sp.SlotReader(path, clock=clk)
    # Three iterations: 30 ms of device work, then 20 ms of input stall.
    for _ in range(3):
        w.busy()
        clk.t += 30 * MS
        w.idle()
        clk.t += 20 * MS
    s = r.read()
    assert s.state == sp.IDLE and s.periods == 3 and s.writer_pid == os.getpid()
    assert s.busy_mean_ns == 30 * MS and s.idle_mean_ns == 20 * MS
    assert s.since_ns == clk.t - 20 * MS
    # A repeated call in the same state publishes nothing new.
    seq = struct.unpack_from("<Q", open(path, "rb").read(), 8)[0]
    w.idle()
    assert struct.unpack_from("<Q", open(path, "rb").read(), 8)[0] == seq and seq % 2 == 0
    w.close()
    assert r.read().state == sp.NONE


def test_gate_fills_the_slot_only_while_the_work_fits_in_it():
    idle = sp.Snapshot(sp.IDLE, since_ns=1000 * MS, idle_mean_ns=20 * MS, busy_mean_ns=30 * MS, periods=5,
                       writer_pid=1)
    assert sp.may_launch(idle, 1000 * MS, 5 * MS) is True
    assert sp.may_launch(idle, 1010 * MS, 5 * MS) is True        # 15 of 16 ms (0.8 x 20)
    assert sp.may_launch(idle, 1012 * MS, 5 * MS) is False       # would run into the next burst
    busy = sp.Snapshot(sp.BUSY, 1000 * MS, 20 * MS, 30 * MS, 5, 1)
    assert sp.may_launch(busy, 1001 * MS, 1 * MS) is False
    # Busy far longer than its bursts: the writer hung or died; the page is not trusted.
    assert sp.may_launch(busy, 1000 * MS + 2 * 10**9, 1 * MS) is None
    # No idle period measured yet: nothing to fill.
    assert sp.may_launch(sp.Snapshot(sp.IDLE, 1000 * MS, 0, 30 * MS, 0, 1), 1000 * MS, MS) is False


@pytest.mark.parametrize("words, why", [
    ((sp.MAGIC, 0, 7, 0, 0, 0, 0, 0), "unknown state"),
    ((sp.MAGIC, 0, sp.IDLE, 2**62, 5, 5, 1, 1), "a time in the future"),
    ((sp.MAGIC, 0, sp.IDLE, 0, sp.MAX_PERIOD_NS + 1, 5, 1, 1), "a period past an hour"),
])
def test_a_hostile_page_is_read_as_nothing(tmp_path, words, why):
    path = _page(tmp_path)
    with open(path, "r+b") as f:
        f.write(struct.pack("<8Q", *words))
    r = sp.SlotReader(path, clock=Clock(10**12))
    assert r.read() is None, why
    assert r.invalid == 1


def test_a_page_left_odd_is_torn_and_read_as_nothing(tmp_path):
    path = _page(tmp_path)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<Q", 3))  # a writer that stopped halfway
    r = sp.SlotReader(path)
    assert r.read() is None and r.torn == 1


def test_wrong_files_are_refused_by_name(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"x" * 100)
    with pytest.raises(sp.SlotPageError, match="100 bytes, expected 4096"):
        sp.SlotReader(str(short))
    other = tmp_path / "other"
    other.write_bytes(b"\0" * sp.PAGE_BYTES)
    with pytest.raises(sp.SlotPageError, match="bad magic"):
        sp.SlotReader(str(other))
    os.symlink(_page(tmp_path), tmp_path / "link")
    with pytest.raises(sp.SlotPageError, match="link"):
        sp.SlotWriter(str(tmp_path / "link"))  # never followed: the path is not the job's to choose


def _hammer(path: str, n: int) -> None:
    w = sp.SlotWriter(path)
    t = 10**9
    for i in range(n):
        # Every snapshot a writer publishes has busy_mean == idle_mean == since (a checkable invariant).
        w._since = w._idle_mean = w._busy_mean = t + i
        w._state = sp.BUSY if i % 2 else sp.IDLE
        w._publish()


def test_seqlock_never_hands_a_reader_a_mixed_snapshot(tmp_path):
    path = _page(tmp_path)
    proc = mp.get_context("fork").Process(target=_hammer, args=(path, 200_000))
    proc.start()
    r = sp.SlotReader(path, clock=lambda: 2**62)
    seen = 0
    while proc.is_alive() or seen == 0:
        s = r.read()
        if s is not None and s.since_ns:
            assert s.since_ns == s.idle_mean_ns == s.busy_mean_ns
            seen += 1
    proc.join()
    assert proc.exitcode == 0 and seen > 0


def test_a_reader_never_sees_the_counter_go_back(tmp_path):
    """The seqlock holds only if ``seq`` is stored whole. struct.pack_into zeroes a field and then
    writes it byte by byte: a reader then saw seq read 0 (even) at both ends of one write and kept a
    half-written body (CI, 2026-11-26). Watched raw, the counter must never decrease."""
    import mmap

    path = _page(tmp_path)
    proc = mp.get_context("fork").Process(target=_hammer, args=(path, 200_000))
    proc.start()
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, sp.PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    words = memoryview(m).cast("Q")
    last, back, reads = 0, 0, 0
    while proc.is_alive():
        seq = words[1]
        reads += 1
        back += seq < last
        last = max(last, seq)
    proc.join()
    last = max(last, words[1])
    words.release()
    m.close()
    assert proc.exitcode == 0 and reads > 100
    assert back == 0, f"seq went back {back} times in {reads} reads"
    assert last == 2 * (200_000 + 1)  # the opening publish and one per iteration, two steps each
