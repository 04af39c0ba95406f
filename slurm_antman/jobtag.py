"""The slurm-antman tag in a job's AdminComment:
``antman:class=CLASS[;req=REQUESTED][;hold=quota][;elastic=MIN:MAX][;gpus=NODE:I+J,NODE:K]``. The grammar and its
vectors are docs/protocol.md ("The AdminComment tag") and docs/contracts.json.

``req`` is what the user asked for when it differs from the class (``auto``, or a guaranteed job the
coordinator turned opportunistic); without it the request was the class itself. ``hold=quota`` marks
a job the coordinator holds because its tenant is over quota, so a restarted coordinator (or anyone
reading squeue) can tell that hold from a user's or admin's own. ``elastic=MIN:MAX`` is an elastic
job's width range (``--antman-elastic``, docs/elastic.md), recorded by job_submit.lua; it is kept
whatever the class becomes (the sidecar uses it only for an opportunistic job); with the job's GPUs on a
node it tells a one-node elastic job from a task of an elastic job array across nodes (``elastic_kind``).
Unknown fields are kept verbatim.

AdminComment is the place because only admins (slurmctld's job_submit plugin, the root Prolog) may
write it: a user cannot forge a class, and every Slurm tool can show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .errors import AntmanError
from .protocol.spec import MAX_JOB_GPUS

PREFIX = "antman:"
CLASSES = ("guaranteed", "opportunistic")
REQUESTS = ("guaranteed", "opportunistic", "auto")
HOLDS = ("quota",)
# An elastic range's bounds: 1 <= MIN <= MAX <= ELASTIC_MAX, job_register's gpus bound.
ELASTIC_MAX = MAX_JOB_GPUS
_KNOWN = ("class", "req", "hold", "elastic", "gpus")
_NODE = re.compile(r"[A-Za-z0-9_.\-]+")
# int() alone would also take "-1", " 1" and "1_0": not GPU indices, and not what render() writes back.
_INDEX = re.compile(r"[0-9]+")
# MIN:MAX, each a decimal number without sign, spaces or leading zero (so one or two digits: at most
# 64), as the SPANK option and job_submit.lua take them and render() writes them back.
_ELASTIC = re.compile(r"([1-9][0-9]?):([1-9][0-9]?)")


class TagError(AntmanError, ValueError):
    """A damaged tag (docs/protocol.md, "The AdminComment tag")."""


@dataclass(frozen=True)
class JobTag:
    job_class: str
    gpus: dict[str, list[int]] = field(default_factory=dict)
    requested: str | None = None   # None: the user asked for job_class itself
    hold: str | None = None
    extra: tuple[tuple[str, str], ...] = ()  # fields a newer release wrote; kept, not interpreted
    elastic: tuple[int, int] | None = None   # (MIN, MAX) of --antman-elastic; None: not elastic

    def __post_init__(self) -> None:
        if self.elastic is not None:
            check_elastic(self.elastic)

    @property
    def request(self) -> str:
        """What the user asked for: guaranteed, opportunistic or auto."""
        return self.requested or self.job_class

    def with_gpus(self, node: str, gpus: list[int]) -> "JobTag":
        merged = dict(self.gpus)
        merged[node] = sorted(gpus)
        return replace(self, gpus=merged)

    def only_on(self, nodes: list[str]) -> "JobTag":
        """The GPU entries of ``nodes`` only: a requeued job's entries for the nodes of an earlier run
        are history, not where it runs now."""
        return replace(self, gpus={n: g for n, g in self.gpus.items() if n in nodes})

    def with_class(self, job_class: str) -> "JobTag":
        if job_class not in CLASSES:
            raise TagError(f"class {job_class!r} is not one of {', '.join(CLASSES)}")
        # the first request is the one to remember: a later class change is the coordinator's doing
        return replace(self, job_class=job_class, requested=self.request if self.request != job_class else None)

    def with_hold(self, hold: str | None) -> "JobTag":
        if hold is not None and hold not in HOLDS:
            raise TagError(f"hold {hold!r} is not one of {', '.join(HOLDS)}")
        return replace(self, hold=hold)

    def render(self) -> str:
        out = f"{PREFIX}class={self.job_class}"
        if self.requested and self.requested != self.job_class:
            out += f";req={self.requested}"
        if self.hold:
            out += f";hold={self.hold}"
        if self.elastic is not None:
            out += f";elastic={self.elastic[0]}:{self.elastic[1]}"
        for k, v in self.extra:
            out += f";{k}={v}"
        if self.gpus:
            out += ";gpus=" + ",".join(f"{n}:{'+'.join(map(str, g))}" for n, g in sorted(self.gpus.items()))
        return out

    @property
    def all_gpus(self) -> list[int]:
        return [g for n in sorted(self.gpus) for g in self.gpus[n]]


def check_elastic(value: object) -> tuple[int, int]:
    """``value`` when it is a tuple (MIN, MAX) of ints with 1 <= MIN <= MAX <= ELASTIC_MAX; TagError otherwise."""
    ok = (type(value) is tuple and len(value) == 2 and all(type(v) is int for v in value)
          and 1 <= value[0] <= value[1] <= ELASTIC_MAX)
    if not ok:
        raise TagError(f"elastic {value!r} is not (MIN, MAX) with 1 <= MIN <= MAX <= {ELASTIC_MAX}")
    return value  # type: ignore[return-value]


def parse_elastic(value: str) -> tuple[int, int]:
    """``MIN:MAX`` (the tag's elastic field, the env file's ANTMAN_ELASTIC) as (MIN, MAX); TagError
    naming the field otherwise."""
    m = _ELASTIC.fullmatch(value)
    if not m:
        raise TagError(f"elastic={value!r} is not MIN:MAX (two decimal numbers, no sign or leading zero)")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1 <= lo <= hi <= ELASTIC_MAX:
        raise TagError(f"elastic={value!r}: want 1 <= MIN <= MAX <= {ELASTIC_MAX}")
    return lo, hi


# What an elastic range means for one job on one node (elastic_kind).
ONE_NODE = "one_node"          # its width changes GPU by GPU on this node (MAX == its GPUs here)
ACROSS_NODES = "across_nodes"  # a task of a job array: one node's share of one job across the array's nodes


def elastic_kind(elastic: tuple[int, int] | None, node_gpus: int) -> str | None:
    """What the tag's range ``elastic`` (MIN, MAX) makes of a job holding ``node_gpus`` GPU slots on this
    node (docs/elastic.md): ``ONE_NODE`` when MAX is those GPUs; ``ACROSS_NODES`` when MAX is a larger
    multiple of them and MIN a multiple too (a task of a job array whose tasks run one training, which
    grows and shrinks a task, so a node's GPUs, at a time: job_submit.lua accepts only such a range for
    an array); None when the job is not elastic: no range, no GPUs, or a range that fits neither (an
    admin's edit; job_submit.lua refuses such a job)."""
    if elastic is None or node_gpus < 1:
        return None
    lo, hi = elastic
    if hi == node_gpus:
        return ONE_NODE
    if hi > node_gpus and hi % node_gpus == 0 and lo % node_gpus == 0:
        return ACROSS_NODES
    return None


def parse_tag(admin_comment: str | None) -> JobTag | None:
    """The tag, or None when the job carries none (class ``none``). A damaged tag raises TagError."""
    if not admin_comment or not admin_comment.startswith(PREFIX):
        return None
    fields: dict[str, str] = {}
    for part in admin_comment[len(PREFIX):].split(";"):
        key, sep, value = part.partition("=")
        if not sep:
            raise TagError(f"AdminComment {admin_comment!r}: {part!r} is not KEY=VALUE")
        fields[key] = value
    cls = fields.get("class")
    if cls not in CLASSES:
        raise TagError(f"AdminComment {admin_comment!r}: class must be one of {', '.join(CLASSES)}")
    gpus: dict[str, list[int]] = {}
    if fields.get("gpus"):
        for entry in fields["gpus"].split(","):
            node, sep, idx = entry.partition(":")
            if not sep or not _NODE.fullmatch(node):
                raise TagError(f"AdminComment {admin_comment!r}: bad GPU entry {entry!r} (want NODE:I+J)")
            indices = idx.split("+") if idx else []
            if not all(_INDEX.fullmatch(i) for i in indices):
                raise TagError(f"AdminComment {admin_comment!r}: bad GPU index in {entry!r}")
            gpus[node] = [int(i) for i in indices]
    req = fields.get("req") or None
    if req is not None and req not in REQUESTS:
        raise TagError(f"AdminComment {admin_comment!r}: req must be one of {', '.join(REQUESTS)}")
    hold = fields.get("hold") or None
    if hold is not None and hold not in HOLDS:
        raise TagError(f"AdminComment {admin_comment!r}: hold must be one of {', '.join(HOLDS)}")
    elastic = None
    if "elastic" in fields:
        try:
            elastic = parse_elastic(fields["elastic"])
        except TagError as e:
            raise TagError(f"AdminComment {admin_comment!r}: {e}") from None
    extra = tuple((k, v) for k, v in fields.items() if k not in _KNOWN)
    return JobTag(cls, gpus, None if req == cls else req, hold, extra, elastic)
