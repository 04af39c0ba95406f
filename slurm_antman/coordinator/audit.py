"""The coordinator's audit log: one JSON object per line, appended and fsync'd before the next step.

It is both the record an admin reads (``antman explain``) and what a restarted coordinator rebuilds
its in-memory state from, so a line is on disk before the coordinator acts on what it says.

Record kinds:

* a decision: ``{"ts", "kind": "<decision kind>", "job_id"|"node", "reason", "inputs", "outcome",
  "error"?, "detail"?}`` with outcome ``ok`` (done in Slurm / sent), ``skipped`` (nothing to do:
  already done, or the job moved on) or ``error`` (failed; retried next cycle).
* ``{"ts", "kind": "state", "state": {...}}``: the policy's CoordinatorState after a cycle.
* ``{"ts", "kind": "coordinator", "event": "start"|"stop", ...}``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

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
    """Appends records to PATH. Thread-safe; every write is flushed and fsync'd."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
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

    def _flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(_jsonable(record), sort_keys=False, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._flush()

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()


def read(path: str | os.PathLike) -> Iterator[dict]:
    """Every well-formed record in order; a torn line (a crash mid-write) is skipped."""
    p = Path(path)
    if not p.exists():
        return
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "kind" in rec:
                yield rec
