"""The one job record every trace format loads into, and the error a malformed trace raises: shared by
the research traces (traces.py) and a site's own sacct history (sacct_trace.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from slurm_antman.errors import AntmanError


class TraceError(AntmanError):
    """A trace that cannot be read: ``path``, ``line`` (1-based, the header is line 1), ``column``."""

    def __init__(self, path: str | Path, line: Optional[int], column: Optional[str], message: str):
        self.path, self.line, self.column = str(path), line, column
        where = str(path) + (f", line {line}" if line is not None else "")
        where += f", column {column!r}" if column else ""
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job as the trace records it (Slurm's jobs are ``slurm.models.Job``, the simulator's ``SimJob``)."""

    job_id: str
    submit_s: float                   # seconds from the trace start
    duration_s: float                 # run time alone on its GPUs
    gpus: int
    tenant: str
    gpu_fraction: Optional[float] = None  # per-GPU share the job asked for (openb gpu_milli / 1000)
    qos: Optional[str] = None             # openb: LS, BE, Burstable, Guaranteed
