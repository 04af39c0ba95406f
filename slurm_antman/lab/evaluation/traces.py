"""Loading real GPU-cluster traces (Microsoft Philly as processed for Pollux, Alibaba PAI openb) into
one job record, streaming with the csv module so a window of a large trace costs one pass and the
memory of the jobs inside the window only.

Times are seconds from the trace start. Philly's start is its earliest submission (the file is not
sorted, so finding it costs one pass, cached per file); openb's times already count from its start.
A malformed row raises :class:`TraceError` naming the file, the line, the column and what was expected,
because a replay that silently drops rows measures a different workload.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Collection, Iterator, Optional

from . import sacct_trace
from .trace_types import TraceError, TraceJob

PHILLY = "philly"
OPENB = "openb"
SACCT = "sacct"  # a site's own history: sacct --json or sacct -P output (sacct_trace.py)

_PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "cluster")
_OPENB_COLUMNS = ("name", "num_gpu", "gpu_milli", "qos", "creation_time", "deletion_time", "scheduled_time")


@dataclass(frozen=True, slots=True)
class Window:
    """``[start_s, end_s)`` in seconds from the trace start; ``None`` is open."""

    start_s: Optional[float] = None
    end_s: Optional[float] = None

    def contains(self, t: float) -> bool:
        return (self.start_s is None or t >= self.start_s) and (self.end_s is None or t < self.end_s)


_NUM = r"\d+(?:\.\d+)?"
_ISO = r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?"
_WINDOW_NUM = re.compile(rf"^({_NUM})?:({_NUM})?$")
_WINDOW_ISO = re.compile(rf"^({_ISO})?(?:/|:(?=\d{{4}}-|$))({_ISO})?$")


def _parse_iso(text: str) -> float:
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)  # the traces carry no zone; UTC keeps it reproducible
    return dt.timestamp()


def parse_window(text: Optional[str], trace_start_unix: Optional[float] = None) -> Window:
    """``START:END`` in seconds from the trace start, or ISO timestamps (``2017-10-01T00:00:00:2017-10-02``,
    or with ``/`` between them). Either side may be empty. ISO needs the trace's absolute start."""
    if text is None or text.strip() == "":
        return Window()
    text = text.strip()
    m = _WINDOW_NUM.match(text)
    if m:
        lo = float(m.group(1)) if m.group(1) else None
        hi = float(m.group(2)) if m.group(2) else None
    else:
        m = _WINDOW_ISO.match(text)
        if not m or not (m.group(1) or m.group(2)):
            raise TraceError("--window", None, None,
                             f"{text!r} is not a window; expected START:END in seconds from the trace start "
                             "(e.g. 0:86400) or ISO timestamps (e.g. 2017-10-01T00:00:00/2017-10-02T00:00:00)")
        if trace_start_unix is None:
            raise TraceError("--window", None, None, "ISO timestamps need a trace with absolute times "
                             "(Philly); openb counts seconds from its start: use START:END in seconds")
        try:
            lo = _parse_iso(m.group(1)) - trace_start_unix if m.group(1) else None
            hi = _parse_iso(m.group(2)) - trace_start_unix if m.group(2) else None
        except ValueError as e:
            raise TraceError("--window", None, None, f"{text!r}: {e}") from None
    if lo is not None and hi is not None and hi <= lo:
        raise TraceError("--window", None, None, f"{text!r}: END must be after START")
    return Window(lo, hi)


def detect_format(path: str | Path) -> str:
    try:
        if sacct_trace.is_sacct(path):
            return SACCT
    except OSError as e:
        raise TraceError(path, None, None, e.strerror or str(e)) from None
    header = _header(path)
    if all(c in header for c in _PHILLY_COLUMNS):
        return PHILLY
    if all(c in header for c in _OPENB_COLUMNS):
        return OPENB
    raise TraceError(path, 1, None, "unknown trace format; expected the Philly columns "
                     f"{', '.join(_PHILLY_COLUMNS)}, the openb pod columns {', '.join(_OPENB_COLUMNS)}, "
                     "or sacct --json or sacct -P output")


def _header(path: str | Path) -> list[str]:
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), [])
    except OSError as e:
        raise TraceError(path, None, None, e.strerror or str(e)) from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise TraceError(path, 1, None, _unreadable(e)) from None


def _unreadable(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason} at byte {e.start})"
    return f"not CSV: {e}"


_start_cache: dict[tuple[str, int, int], float] = {}


def trace_start_unix(path: str | Path) -> Optional[float]:
    """Absolute start of a Philly trace or a sacct history (its earliest submission); None for openb
    (relative times)."""
    fmt = detect_format(path)
    if fmt == SACCT:
        return sacct_trace.first_submit_unix(path)
    if fmt != PHILLY:
        return None
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    if key not in _start_cache:
        earliest: Optional[float] = None
        for line, row in _rows(path, _PHILLY_COLUMNS):
            t = _timestamp(path, line, row, "timestamp")
            earliest = t if earliest is None else min(earliest, t)
        if earliest is None:
            raise TraceError(path, None, None, "the trace has no jobs")
        _start_cache[key] = earliest
    return _start_cache[key]


def _rows(path: str | Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        f = open(path, newline="")
    except OSError as e:
        raise TraceError(path, None, None, e.strerror or str(e)) from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise TraceError(path, 1, None, "empty file; expected a CSV header")
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(path, 1, missing[0], f"header lacks column(s) {', '.join(missing)}")
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) < len(header):
                    raise TraceError(path, line, header[len(row)],
                                     f"row has {len(row)} fields, the header has {len(header)}: column missing")
                yield line, dict(zip(header, row))
        except (UnicodeDecodeError, csv.Error) as e:
            raise TraceError(path, reader.line_num + 1, None, _unreadable(e)) from None


def _number(path, line: int, row: dict[str, str], col: str, *, integer: bool = False,
            minimum: Optional[float] = 0.0, allow_empty: bool = False) -> Optional[float]:
    text = row[col].strip()
    if text == "" and allow_empty:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TraceError(path, line, col, f"{text!r} is not a number; expected "
                         + ("an integer" if integer else "a number of seconds")) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise TraceError(path, line, col, f"{text!r} is not a finite number")
    if integer and value != int(value):
        raise TraceError(path, line, col, f"{text!r} is not an integer")
    if minimum is not None and value < minimum:
        raise TraceError(path, line, col, f"{text} is negative; expected a value >= {minimum:g}")
    return value


def _timestamp(path, line: int, row: dict[str, str], col: str) -> float:
    text = row[col].strip()
    try:
        return _parse_iso(text)
    except ValueError:
        raise TraceError(path, line, col, f"{text!r} is not a timestamp; expected YYYY-MM-DD HH:MM:SS") from None


def _tenant_ok(tenant: str, tenants: Optional[Collection[str]]) -> bool:
    return not tenants or tenant in tenants


def _philly(path, window: Window, tenants, start: float) -> Iterator[TraceJob]:
    for line, row in _rows(path, _PHILLY_COLUMNS):
        submit = _timestamp(path, line, row, "timestamp") - start
        duration = _number(path, line, row, "duration")
        gpus = _number(path, line, row, "num_gpus", integer=True, minimum=1)
        tenant = row["cluster"].strip()
        if not tenant:
            raise TraceError(path, line, "cluster", "empty; expected the virtual cluster (tenant) id")
        if window.contains(submit) and _tenant_ok(tenant, tenants):
            # The file has no job id; its line number is stable and lets a reader find the row.
            yield TraceJob(f"philly-{line}", submit, float(duration), int(gpus), tenant)


@dataclass(slots=True)
class OpenbSkips:
    """Pods an openb replay leaves out, and why (counted, so a report can say so)."""

    cpu_only: int = 0      # num_gpu 0: not GPU work
    never_ran: int = 0     # no scheduled_time: pending at the trace end, no run time to replay


def _openb(path, window: Window, tenants, skips: Optional[OpenbSkips]) -> Iterator[TraceJob]:
    for line, row in _rows(path, _OPENB_COLUMNS):
        created = _number(path, line, row, "creation_time")
        deleted = _number(path, line, row, "deletion_time")
        scheduled = _number(path, line, row, "scheduled_time", allow_empty=True)
        gpus = _number(path, line, row, "num_gpu", integer=True)
        milli = _number(path, line, row, "gpu_milli", integer=True)
        if milli > 1000:
            raise TraceError(path, line, "gpu_milli", f"{row['gpu_milli']} exceeds 1000 (one whole GPU)")
        qos = row["qos"].strip()
        if not qos:
            raise TraceError(path, line, "qos", "empty; expected LS, BE, Burstable or Guaranteed")
        if scheduled is not None and deleted < scheduled:
            raise TraceError(path, line, "deletion_time",
                             f"{row['deletion_time']} is before scheduled_time {row['scheduled_time']}: "
                             "negative duration")
        if gpus == 0:
            if skips is not None:
                skips.cpu_only += 1
            continue
        if scheduled is None:
            if skips is not None:
                skips.never_ran += 1
            continue
        tenant = "default"  # the pod list is one namespace; the qos class is kept apart
        if window.contains(created) and _tenant_ok(tenant, tenants):
            yield TraceJob(row["name"].strip(), float(created), float(deleted - scheduled), int(gpus), tenant,
                      (milli / 1000.0) if milli else 1.0, qos)


def load(path: str | Path, window: Window | str | None = None, tenants: Optional[Collection[str]] = None,
         skips: Optional[object] = None) -> Iterator[TraceJob]:
    """Jobs of the trace submitted inside ``window`` (of the listed tenants), in file order (a sacct
    history: by submission). ``skips``: an ``OpenbSkips`` or ``sacct_trace.SacctSkips`` to count into."""
    fmt = detect_format(path)
    if fmt == SACCT:
        jobs, start = sacct_trace.load_with_start(path, skips if isinstance(skips, sacct_trace.SacctSkips) else None)
        if not isinstance(window, Window):
            window = parse_window(window, start)
        wanted = set(tenants) if tenants else None
        return iter([j for j in jobs if window.contains(j.submit_s) and _tenant_ok(j.tenant, wanted)])
    start = trace_start_unix(path) if fmt == PHILLY else None
    if not isinstance(window, Window):
        window = parse_window(window, start)
    tenants = set(tenants) if tenants else None
    if fmt == PHILLY:
        assert start is not None
        return _philly(path, window, tenants, start)
    return _openb(path, window, tenants, skips if isinstance(skips, OpenbSkips) else None)


def load_sorted(path: str | Path, window: Window | str | None = None,
                tenants: Optional[Collection[str]] = None) -> list[TraceJob]:
    """The window's jobs ordered by submission (ties by id), as a replay consumes them."""
    return sorted(load(path, window, tenants), key=lambda j: (j.submit_s, j.job_id))
