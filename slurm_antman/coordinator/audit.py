"""The coordinator's audit log: one JSON object per line, appended and fsync'd before the next step.

It is both the record an admin reads (``antman explain``) and what a restarted coordinator rebuilds
its in-memory state from, so a line is on disk before the coordinator acts on what it says.

Record kinds:

* a decision: ``{"ts", "kind": "<decision kind>", "job_id"|"node", "reason", "inputs", "outcome",
  "error"?, "detail"?}`` with outcome ``ok`` (done in Slurm / sent), ``skipped`` (nothing to do:
  already done, or the job moved on) or ``error`` (failed; retried next cycle).
* ``{"ts", "kind": "state", "state": {...}}``: the policy's CoordinatorState after a cycle.
* ``{"ts", "kind": "coordinator", "event": "start"|"stop", ...}``.

Rotation: past ``max_bytes`` the file is renamed PATH.1 (PATH.1 to PATH.2, and so on, ``keep`` of them)
and a new PATH begun, always just before a ``state`` record, so that PATH begins with the complete
state and a restarted coordinator needs nothing older (see daemon.restore_state). History (explain,
the benches) is read from every rotated file, oldest first. ``reopen`` (SIGHUP) serves a site whose
logrotate renames the file instead.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import ExitStack
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Optional

OUTCOMES = ("ok", "skipped", "error")


def _jsonable(v: Any) -> Any:
    if is_dataclass(v) and not isinstance(v, type):
        return {f.name: _jsonable(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_jsonable(x) for x in v]
        return sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def decision_record(decision: Any, outcome: str, ts: float, error: Optional[str] = None,
                    detail: Optional[str] = None) -> dict:
    """The audit line of one executed decision (any policy decision dataclass)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
    body = _jsonable(decision)
    rec: dict[str, Any] = {"ts": round(ts, 3), "kind": decision.kind}
    for key in ("job_id", "node"):
        if key in body:
            rec[key] = body.pop(key)
    rec["reason"] = body.pop("reason", "")
    rec["inputs"] = body.pop("inputs", {})
    rec["params"] = body  # the decision's own fields (to_class, slots, grace_s, ...)
    rec["outcome"] = outcome
    if error:
        rec["error"] = error
    if detail:
        rec["detail"] = detail
    return rec


class AuditLog:
    """Appends records to PATH. Thread-safe; every write is flushed and fsync'd. ``max_bytes`` (0: never)
    rotates the file at the first ``state`` record written once it has grown that large."""

    def __init__(self, path: str | os.PathLike, max_bytes: int = 0, keep: int = 5):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        # A crash can leave a partial last line; start ours on a fresh one so both stay readable.
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._f = os.fdopen(fd, "a", encoding="utf-8")
        if needs_newline:
            self._f.write("\n")
            self._flush()
        self._size = os.fstat(fd).st_size

    def _flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    @property
    def rotation_due(self) -> bool:
        """The file has reached ``max_bytes``: the next ``state`` record begins a new one."""
        return bool(self.max_bytes) and self._size >= self.max_bytes

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(_jsonable(record), sort_keys=False, separators=(",", ":")) + "\n"
        with self._lock:
            if record.get("kind") == "state" and self.rotation_due:
                self._rotate()
            self._f.write(line)
            self._flush()
            self._size += len(line.encode("utf-8"))

    def _rotate(self) -> None:
        # Every line in the file was fsync'd when written; the renames are made durable (the
        # directory fsync'd) before the new file takes a line, so a crash leaves either the old
        # names or the new ones, never a record in neither.
        self._f.close()
        for n, old in [(n, q) for n, q in _numbered(self.path) if n >= self.keep]:
            old.unlink(missing_ok=True)  # PATH.keep is about to be replaced; any beyond it, from a larger keep
        for n in range(self.keep - 1, 0, -1):
            src = self._name(n)
            if src.exists():
                os.replace(src, self._name(n + 1))
        os.replace(self.path, self._name(1))
        _fsync_dir(self.path.parent)
        self._open()

    def _name(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def reopen(self) -> None:
        """Close PATH and open it again (creating it): after an outside tool renamed it."""
        with self._lock:
            if not self._f.closed:
                self._f.close()
            self._open()

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbered(path: Path) -> list[tuple[int, Path]]:
    """PATH's rotated files (PATH.1, PATH.2, ...) as (number, path), newest (lowest number) first."""
    prefix = path.name + "."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    found = [(int(n[len(prefix):]), path.with_name(n)) for n in names
             if n.startswith(prefix) and n[len(prefix):].isdigit()]
    return sorted(found)


def files(path: str | os.PathLike) -> list[Path]:
    """PATH and its rotated files, newest first."""
    p = Path(path)
    return [p, *(q for _, q in _numbered(p))]


def _open_history(path: str | os.PathLike, stack: ExitStack) -> list[IO[str]]:
    """Every file of the log, open, oldest first. Opened newest first and each inode once: a rotation
    while they are opened renames PATH to PATH.1, and the same file is then met under its new name
    (an open file keeps its content whatever it is renamed to)."""
    opened: list[IO[str]] = []
    seen: set[tuple[int, int]] = set()
    for p in files(path):
        try:
            f = stack.enter_context(open(p, encoding="utf-8", errors="replace"))
        except (FileNotFoundError, IsADirectoryError):
            continue
        st = os.fstat(f.fileno())
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        opened.append(f)
    opened.reverse()
    return opened


def lines(path: str | os.PathLike) -> Iterator[str]:
    """Every line of the log, from its oldest rotated file to PATH."""
    with ExitStack() as stack:
        for f in _open_history(path, stack):
            yield from f


def _records(text_lines: Iterator[str]) -> Iterator[dict]:
    for line in text_lines:
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "kind" in rec:
            yield rec


def read(path: str | os.PathLike) -> Iterator[dict]:
    """Every well-formed record in order, rotated files first; a torn line (a crash mid-write) is skipped."""
    yield from _records(lines(path))


def read_file(path: str | os.PathLike) -> Iterator[dict]:
    """The well-formed records of this one file (not its rotated ones)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from _records(iter(f))
    except FileNotFoundError:
        return
