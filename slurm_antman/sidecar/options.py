"""The sidecar's options for one node, as ``slurm_antman.sidecar.cli`` builds them from antman.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slurm_antman.policy.node import compliance
from slurm_antman.policy.node.core import NodePolicyParams
from slurm_antman.policy.progress import FILL_EFFICIENCY

from .uplink import UplinkOptions


@dataclass(frozen=True)
class SidecarOptions:
    node: str
    socket_dir: str
    heartbeat_s: float = 1.0
    grace_s: float = 30.0
    slots_per_gpu: int = 2
    utilization_threshold: float = 0.8
    utilization_window_s: float = 10.0
    tick_s: float = 1.0
    opportunistic_throttle: str = "launch"
    params: NodePolicyParams = NodePolicyParams()
    uplink: Optional[UplinkOptions] = None  # None: no coordinator; the sidecar notifies preemptions itself
    enforce: bool = True  # False: observe only (sidecar.enforce)
    no_room_wait: bool = True  # opportunistic.no_room == "wait"
    hooks_state_dir: Optional[str] = None  # where the Prolog writes this node's env files (state_dir/NODE)
    compliance: compliance.ComplianceParams = compliance.ComplianceParams()
    slot_filling: bool = False  # sidecar.slot_filling: idle-slot pages (slot_pages.py)
    slot_fill: float = FILL_EFFICIENCY  # sidecar.slot_fill_efficiency: what the placement counts on
