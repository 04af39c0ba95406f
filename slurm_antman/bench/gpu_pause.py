"""Part 7: pause and resume in place (issue 16), the time to free the GPU and to resume.

Not built yet: the protocol has no ``pause`` message and the agent cannot move a job's state to the
host. Until it has, the part is skipped with that reason (decided before any process starts, by
:func:`missing`), and the gpu test of it skips with the same reason.
"""

from __future__ import annotations

from typing import Optional

from .gpu_part import PartContext, PartSkipped

REASON = "pause/resume not implemented (issue 16)"


def missing() -> Optional[str]:
    """Why the part cannot run, or None once the protocol carries ``pause`` and ``resume``."""
    from slurm_antman import protocol as P

    return None if hasattr(P, "Pause") and hasattr(P, "Resume") else REASON


def run(ctx: PartContext) -> None:
    reason = missing()
    if reason is not None:
        raise PartSkipped(reason)
    # Issue 16 adds the measurement here: pause a training opportunistic job beside a guaranteed one,
    # time the ack (GPU memory freed, NVML's figure) and the resume (first iteration after it).
    raise PartSkipped("pause/resume exists, but this part has not been written for it yet (issue 16)")
