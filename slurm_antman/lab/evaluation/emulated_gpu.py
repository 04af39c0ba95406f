"""The shared state of an emulated GPU: how co-located emulated jobs see each other's load.

A trace replay on the devcluster runs emulated training jobs (``emulated_job``) on emulated GPUs. The
workload model slows a job by the load of the *other* jobs on its GPU (``Profile.slowdown``), and the
sidecar does not tell a job who its neighbours are, so the jobs on one GPU meet on a *board*: a
directory ``ROOT/<node>/<gpu>/`` with one small JSON file per job, ``<job_id>``:
``{"load": sm_util * share, "mem_bytes": footprint, "t": unix_time, "since": unix_time, "kind": kind,
"share": share}`` (``t``: the last refresh; ``since``: the job's first publish, its arrival on the GPU;
entries written before ``since`` existed are still read, as having been there before anyone else;
``kind`` and ``share``: the workload model's interference kind and the job's compute share, from
which a neighbour's slowdown follows, ``Profile.slowdown``; an entry without a kind slows nobody).

Files, not a server: the jobs of a node share its file system, a killed job needs no clean-up (its
entry goes stale after ``stale_s``), and dozens of jobs reading once a second cost nothing. Writes are
atomic (a temporary file, then ``os.replace``), and a reader skips whatever it cannot parse (a file
from another tool, a truncated write on a full disk), so no reader ever fails on the board.

Out of memory (the ``shared`` policy: nobody limits anyone's memory): when the footprints on a GPU
sum over its memory, the job that arrived last fails, as the simulator has it. Every job on the GPU
decides this alone, from the board only (:func:`oom_decision`), and all of them reach the same
answer because "last" is a total order: ``since``, then the job id.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

DEFAULT_STALE_S = 10.0
# A job reads its neighbours about once a second: loads change at the coordinator's and the local
# policy's pace (seconds), not per mini-batch.
DEFAULT_READ_INTERVAL_S = 1.0
# An entry is a few dozen bytes; anything much larger is not ours.
_MAX_ENTRY_BYTES = 4096
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class BoardError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    job_id: str
    load: float
    mem_bytes: int
    t: float
    since: Optional[float] = None  # None: written by a job from before ``since`` existed
    kind: Optional[str] = None     # the workload model's interference kind; None: unknown
    share: float = 1.0             # the job's compute share (1.0: uncontrolled)


# What a job concludes from the board about out-of-memory on its GPUs (see oom_decision).
OK, WAIT, OOM = "ok", "wait", "oom"


def _check_name(what: str, value: str) -> str:
    # Names become path components: nothing that could climb out of the board or hide as a temp file.
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise BoardError(f"{what} {value!r}: allowed are letters, digits, '_', '.', '-' "
                         "(not starting with '.' or '-'), at most 128 characters")
    return value


def parse_entry(job_id: str, raw: bytes) -> Optional[Entry]:
    """An entry from a file's bytes, or None if they are not a well-formed entry."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(d, dict):
        return None
    load, mem, t = d.get("load"), d.get("mem_bytes"), d.get("t")
    for v in (load, t):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
    if isinstance(mem, bool) or not isinstance(mem, int) or mem < 0 or load < 0:
        return None
    since = d.get("since")  # absent in entries from before it existed: still a good entry
    if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))
                              or not math.isfinite(since)):
        return None
    kind, share = d.get("kind"), d.get("share", 1.0)
    if kind is not None and (not isinstance(kind, str) or not _NAME_RE.match(kind)):
        return None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
        return None
    return Entry(job_id, float(load), mem, float(t), None if since is None else float(since), kind, float(share))


def arrival_key(job_id: str, since: Optional[float]) -> tuple:
    """The order of arrival on a GPU, the same for every reader: ``since``, ties (two jobs in the
    same clock tick) broken by job id, numerically for Slurm's numeric ids (the later submission is
    the later arrival). An entry without ``since`` counts as the earliest: its writer never fails
    itself on OOM, so the job that can must be the one to give way."""
    s = -math.inf if since is None else since
    ident = (0, int(job_id), "") if job_id.isdigit() else (1, 0, job_id)
    return (s, ident)


def oom_decision(entries: Sequence[Entry], job_id: str, since: float, mem_bytes: int, capacity: int) -> str:
    """What job ``job_id`` (arrived at ``since``, footprint ``mem_bytes``) concludes about one GPU of
    ``capacity`` bytes from the fresh ``entries`` on its board (its own entry, if there, is ignored:
    the job passes its own numbers).

    - ``OK``: the footprints fit, or a job that arrived later is on the GPU (that one fails instead).
    - ``OOM``: they overflow, this job arrived last, and the overflow holds counting only the
      neighbours that refreshed their entry after this job arrived: alive for certain.
    - ``WAIT``: it overflows only with neighbours that have not refreshed since this job arrived.
      Such an entry may be a dead job's (killed before it could withdraw; it would go stale within
      ``stale_s``) or one that was itself still deciding when this job came. Ask again: a live
      neighbour refreshes within about a second, a dead one goes stale.
    """
    others = [e for e in entries if e.job_id != job_id]
    if mem_bytes + sum(e.mem_bytes for e in others) <= capacity:
        return OK
    mine = arrival_key(job_id, since)
    if any(arrival_key(e.job_id, e.since) > mine for e in others):
        return OK
    alive = sum(e.mem_bytes for e in others if e.t > since)
    return OOM if mem_bytes + alive > capacity else WAIT


@dataclass(frozen=True)
class OomCheck:
    """The verdict over a job's GPUs: the first GPU that overflows (OOM) or may (WAIT), and the bytes
    the other jobs hold there, for the error message."""

    decision: str
    gpu: Optional[int] = None
    others_bytes: int = 0


def write_json_atomic(path: str, data: Any) -> None:
    """Readers see the old file or the new one, never half of one. No fsync: what is written must
    survive the writer being killed, not the node crashing. The temporary name starts with a dot,
    which readers of the board skip."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class Board:
    """One job's view of the boards of its GPUs on ``node``."""

    def __init__(
        self,
        root: str,
        node: str,
        gpus: Sequence[int],
        stale_s: float = DEFAULT_STALE_S,
        read_interval_s: float = DEFAULT_READ_INTERVAL_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_name("node", node)
        gpus = list(gpus)
        if not gpus or any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
            raise BoardError(f"gpus {gpus!r}: a non-empty list of GPU indices (integers >= 0)")
        if not stale_s > 0:
            raise BoardError(f"stale_s must be > 0, got {stale_s}")
        if read_interval_s < 0:
            raise BoardError(f"read_interval_s must be >= 0, got {read_interval_s}")
        self.root = root
        self.node = node
        self.gpus = sorted(set(gpus))
        self.stale_s = stale_s
        self.read_interval_s = read_interval_s
        self._clock = clock
        self._monotonic = monotonic
        self._dirs = {g: os.path.join(root, node, str(g)) for g in self.gpus}
        self._cache: Optional[dict[int, list[Entry]]] = None
        self._read_at = 0.0
        self._since: dict[str, float] = {}  # job id -> its arrival, fixed at its first publish

    def gpu_dir(self, gpu: int) -> str:
        return self._dirs[gpu]

    # --- writing ----------------------------------------------------------------------------

    def publish(self, job_id: str, load: float, mem_bytes: int, kind: Optional[str] = None,
                share: float = 1.0) -> None:
        """Puts (or refreshes) ``job_id``'s entry on each of this board's GPUs."""
        _check_name("job_id", job_id)
        if kind is not None:
            _check_name("kind", kind)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
            raise BoardError(f"share must be a finite number >= 0, got {share!r}")
        if isinstance(load, bool) or not isinstance(load, (int, float)) or not math.isfinite(load) or load < 0:
            raise BoardError(f"load must be a finite number >= 0, got {load!r}")
        if isinstance(mem_bytes, bool) or not isinstance(mem_bytes, int) or mem_bytes < 0:
            raise BoardError(f"mem_bytes must be an integer >= 0, got {mem_bytes!r}")
        now = self._clock()
        since = self._since.get(job_id)
        if since is None:
            since = self._since[job_id] = self._arrival(job_id, now)
        data = {"load": float(load), "mem_bytes": mem_bytes, "t": now, "since": since, "share": float(share)}
        if kind is not None:
            data["kind"] = kind
        for d in self._dirs.values():
            os.makedirs(d, exist_ok=True)
            write_json_atomic(os.path.join(d, job_id), data)

    def _arrival(self, job_id: str, now: float) -> float:
        """``now``, or the ``since`` of a fresh entry of the same job: the ranks of a multi-GPU job
        publish one shared entry per GPU, and their arrival must not move when a later rank starts."""
        earlier = [e.since for g in self.gpus for e in self.entries(g)
                   if e.job_id == job_id and e.since is not None]
        return min([now, *earlier])

    def since(self, job_id: str) -> Optional[float]:
        """This job's arrival as it was published, None before its first publish."""
        return self._since.get(job_id)

    def withdraw(self, job_id: str) -> None:
        _check_name("job_id", job_id)
        for d in self._dirs.values():
            try:
                os.unlink(os.path.join(d, job_id))
            except FileNotFoundError:
                pass
        self._since.pop(job_id, None)
        self._cache = None

    # --- reading ----------------------------------------------------------------------------

    def entries(self, gpu: int) -> list[Entry]:
        """The fresh, well-formed entries on ``gpu`` (read now, no cache)."""
        d = self._dirs[gpu]
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        now = self._clock()
        out: list[Entry] = []
        for name in names:
            if name.startswith(".") or not _NAME_RE.match(name):
                continue  # a write in progress, or not an entry
            try:
                with open(os.path.join(d, name), "rb") as f:
                    raw = f.read(_MAX_ENTRY_BYTES + 1)
            except OSError:  # withdrawn meanwhile, or a directory
                continue
            if len(raw) > _MAX_ENTRY_BYTES:
                continue
            e = parse_entry(name, raw)
            if e is not None and now - e.t <= self.stale_s:
                out.append(e)
        return out

    def _read(self) -> dict[int, list[Entry]]:
        now = self._monotonic()
        if self._cache is None or now - self._read_at >= self.read_interval_s:
            self._cache = {g: self.entries(g) for g in self.gpus}
            self._read_at = now
        return self._cache

    def slowdown(self, job_id: str, profile: Any) -> float:
        """``profile.slowdown`` beside the other jobs on each GPU, the largest over this board's GPUs
        (a multi-GPU job's mini-batch waits for its slowest GPU). Cached for ``read_interval_s``."""
        per_gpu = self._read()
        return max((profile.slowdown([(e.kind, e.share) for e in es if e.job_id != job_id and e.kind])
                    for es in per_gpu.values()), default=1.0)

    def neighbour_mem(self, job_id: str) -> int:
        """Sum of the other jobs' footprints on a GPU, the largest over this board's GPUs."""
        per_gpu = self._read()
        return max((sum(e.mem_bytes for e in es if e.job_id != job_id) for es in per_gpu.values()), default=0)

    def oom_check(self, job_id: str, mem_bytes: int, capacity: int, fresh: bool = False) -> OomCheck:
        """:func:`oom_decision` over this board's GPUs, for a job that has published. ``fresh``
        reads the board now instead of within ``read_interval_s`` (while the job waits to start)."""
        since = self._since.get(job_id)
        if since is None:
            raise BoardError(f"job {job_id!r} has not published on this board: nothing to decide")
        if fresh:
            self._cache = None
        waiting: Optional[OomCheck] = None
        for g, es in self._read().items():
            d = oom_decision(es, job_id, since, mem_bytes, capacity)
            if d == OOM:
                return OomCheck(OOM, g, sum(e.mem_bytes for e in es if e.job_id != job_id))
            if d == WAIT and waiting is None:
                waiting = OomCheck(WAIT, g)
        return waiting or OomCheck(OK)
