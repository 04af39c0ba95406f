"""The coordinator's policy core: pure functions from a cluster snapshot to decisions (no I/O, no
clock, no Slurm, no ZeroMQ), so the daemon and the trace simulator run the same policy."""

from .core import decide, decide_with_room
from .decisions import (
    ALL_KINDS, CheckpointNotice, Decision, HoldForQuota, KeepOff, MakeEligible, PreemptNotice, ReleaseHold, Requeue, SetClass, SetOppSlots, Upgrade,
)
from .model import (
    HOLDING_STATES, CoordinatorState, GpuView, Issued, JobView, NodeView, PolicyParams, Preemption, PreemptNeed, Requeued, Snapshot, quotas_from_config,
)
from .preemption import lost_gpu_seconds

__all__ = [
    "decide", "decide_with_room", "ALL_KINDS", "CheckpointNotice", "Decision", "HoldForQuota", "KeepOff", "MakeEligible", "PreemptNotice", "ReleaseHold", "Requeue",
    "SetClass", "SetOppSlots", "Upgrade", "HOLDING_STATES", "CoordinatorState", "GpuView", "Issued", "JobView",
    "NodeView", "PolicyParams", "Preemption", "PreemptNeed", "Requeued", "Snapshot", "quotas_from_config",
    "lost_gpu_seconds",
]
