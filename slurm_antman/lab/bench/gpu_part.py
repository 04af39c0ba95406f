"""What a part of ``antman bench gpu`` runs with: its deadline, and a record that is on disk after
every change, so a part killed at its budget (or crashing in a CUDA callback) still leaves what it
measured up to then.

A part is a function ``run(ctx: PartContext) -> None`` in a module of this package, run in a process
of its own by ``gpu.py``. It measures, records numbers with :meth:`PartContext.put`, and turns each
claim of docs/gpu_proof.md into a named check with :meth:`PartContext.check` (the value measured and what was
expected, in words). It raises :class:`PartSkipped` when it finds it cannot run here.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional


class PartSkipped(Exception):
    """Raised by a part that finds, once started, that it cannot run here (the message says why)."""


class PartContext:
    def __init__(self, name: str, budget_s: float, record_path: str, workdir: str) -> None:
        self.name = name
        self.budget_s = budget_s
        self.record_path = record_path
        self.workdir = workdir  # scratch space of this part (sockets, per-chunk files)
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.doc: dict[str, Any] = {"name": name, "results": {}, "checks": [], "summary": []}
        self.flush()

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.deadline - time.monotonic()

    def put(self, key: str, value: Any) -> Any:
        self.doc["results"][key] = value
        self.flush()
        return value

    def check(self, name: str, ok: bool, value: Any, expect: str) -> bool:
        """One claim of docs/gpu_proof.md, measured: ``value`` is what was seen, ``expect`` the rule."""
        self.doc["checks"].append({"name": name, "ok": bool(ok), "value": value, "expect": expect})
        self.flush()
        return bool(ok)

    def note(self, line: str) -> None:
        """A line for gpu.md's section of this part (the numbers a reader wants first)."""
        self.doc["summary"].append(line)
        self.flush()

    def finish(self, **fields: Any) -> None:
        self.doc.update(fields)
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 2)
        self.flush()

    def flush(self) -> None:
        write_json(self.record_path, self.doc)


def write_json(path: str, doc: Any) -> None:
    """Atomically: a reader (the runner, after a kill) sees the old or the new file, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(clean(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def clean(v: Any) -> Any:
    """JSON-safe: NaN and infinities (a measurement that did not happen) become null, tuples lists,
    anything else unknown its string."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude (0 when both are 0)."""
    m = max(abs(a), abs(b))
    return abs(a - b) / m if m > 0 else 0.0
