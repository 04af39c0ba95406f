"""What the policy core asks the coordinator to do. The executor turns each into Slurm or sidecar calls;
the audit log records ``as_record()`` of each (what, why, and the inputs it was based on).

Two decisions are equal when they ask for the same thing: ``reason`` and ``inputs`` are not compared,
so a test can write ``SetClass("7", "guaranteed", "", {}) in decisions``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


_KIND_OF: dict[type, str] = {}


class _Kind:
    __slots__ = ()

    @property
    def kind(self) -> str:
        cls = type(self)
        name = _KIND_OF.get(cls)
        if name is None:
            name = _KIND_OF[cls] = _CAMEL.sub("_", cls.__name__).lower()
        return name

    @property
    def key(self) -> str:
        """What the decision is about: ``job:ID`` or ``node:NAME`` (at most one decision per key and cycle)."""
        node = getattr(self, "node", None)
        if node is not None and not hasattr(self, "job_id"):
            return f"node:{node}"
        return f"job:{self.job_id}"  # type: ignore[attr-defined]

    @property
    def signature(self) -> str:
        """``kind`` plus its target, e.g. ``set_class:opportunistic``: what suppresses a repeat."""
        target = getattr(self, "to_class", None)
        if target is None:
            target = getattr(self, "slots", None)
        return self.kind if target is None else f"{self.kind}:{target}"

    def as_record(self) -> dict:
        rec: dict = {"kind": self.kind}
        for name in self.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            rec[name] = dict(value) if name == "inputs" else value
        return rec


def _inputs() -> dict:
    return {}


@dataclass(frozen=True, slots=True)
class SetClass(_Kind):
    """Pending job: give it ``to_class`` (resolve ``auto``, or send a guaranteed job that waited too
    long to run opportunistic). ``release_hold``: it is held for quota and must be released too."""

    job_id: str
    to_class: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)
    release_hold: bool = False


@dataclass(frozen=True, slots=True)
class HoldForQuota(_Kind):
    job_id: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)


@dataclass(frozen=True, slots=True)
class ReleaseHold(_Kind):
    job_id: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)


@dataclass(frozen=True, slots=True)
class SetOppSlots(_Kind):
    """slurmctld's count of the opportunistic GRES on ``node``: slots in use plus slots that fit."""

    node: str
    slots: int
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)


@dataclass(frozen=True, slots=True)
class Upgrade(_Kind):
    """Running opportunistic job becomes guaranteed in place: AdminComment, then the sidecar's
    ``job_class_update`` so it stops throttling and limiting the job."""

    job_id: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)


@dataclass(frozen=True, slots=True)
class PreemptNotice(_Kind):
    """Tell the job's agent (via its node's sidecar) and send the job its ``--signal``."""

    job_id: str
    node: str
    grace_s: float
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)


@dataclass(frozen=True, slots=True)
class CheckpointNotice(_Kind):
    """A running task of an elastic array checkpoints ``at_s`` seconds from now (via its node's sidecar):
    a sibling task leaves then (its requeue), or has just joined (``cause``: what it is for)."""

    job_id: str
    node: str
    at_s: float
    cause: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)

    @property
    def key(self) -> str:
        # Its own key per cause: another decision for the task in the same cycle must not suppress it.
        return f"checkpoint:{self.job_id}:{self.cause}"


@dataclass(frozen=True, slots=True)
class Requeue(_Kind):
    """Grace time is over: ``scontrol requeue``."""

    job_id: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)


@dataclass(frozen=True, slots=True)
class MakeEligible(_Kind):
    """A job we requeued: clear Slurm's ~121 s BeginTime wait (``scontrol update StartTime=now``), or,
    with ``start_unix``, set it to that time instead (a shed task of an elastic array waits its hold)."""

    job_id: str
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)
    start_unix: Optional[float] = None


@dataclass(frozen=True, slots=True)
class KeepOff(_Kind):
    """Pending opportunistic job: its ``ExcNodeList`` becomes ``nodes`` (what the user excluded plus the
    nodes whose GPUs have no room), so Slurm does not start it on the one slot such a node keeps."""

    job_id: str
    nodes: tuple[str, ...]
    reason: str = field(default="", compare=False)
    inputs: Mapping[str, object] = field(default_factory=_inputs, compare=False)

    @property
    def key(self) -> str:
        # Its own key: a class decision for the same job in the same cycle must not suppress it.
        return f"keep_off:{self.job_id}"

    @property
    def signature(self) -> str:
        return "keep_off:" + ",".join(self.nodes)


Decision = Union[SetClass, HoldForQuota, ReleaseHold, SetOppSlots, Upgrade, PreemptNotice, Requeue, MakeEligible,
                 KeepOff, CheckpointNotice]

ALL_KINDS = (SetClass, HoldForQuota, ReleaseHold, SetOppSlots, Upgrade, PreemptNotice, Requeue, MakeEligible,
             KeepOff, CheckpointNotice)
