"""The slurm-antman tag in a job's AdminComment: ``antman:class=CLASS[;gpus=NODE:I+J,NODE:K]``.

AdminComment is the place because only admins (slurmctld's job_submit plugin, the root Prolog) may
write it: a user cannot forge a class, and every Slurm tool can show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PREFIX = "antman:"
CLASSES = ("guaranteed", "opportunistic")
_NODE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TagError(ValueError):
    pass


@dataclass(frozen=True)
class JobTag:
    job_class: str
    gpus: dict[str, list[int]] = field(default_factory=dict)

    def with_gpus(self, node: str, gpus: list[int]) -> "JobTag":
        merged = dict(self.gpus)
        merged[node] = sorted(gpus)
        return JobTag(self.job_class, merged)

    def render(self) -> str:
        out = f"{PREFIX}class={self.job_class}"
        if self.gpus:
            out += ";gpus=" + ",".join(f"{n}:{'+'.join(map(str, g))}" for n, g in sorted(self.gpus.items()))
        return out

    @property
    def all_gpus(self) -> list[int]:
        return [g for n in sorted(self.gpus) for g in self.gpus[n]]


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
            if not sep or not _NODE.match(node):
                raise TagError(f"AdminComment {admin_comment!r}: bad GPU entry {entry!r} (want NODE:I+J)")
            try:
                gpus[node] = [int(i) for i in idx.split("+")] if idx else []
            except ValueError:
                raise TagError(f"AdminComment {admin_comment!r}: bad GPU index in {entry!r}") from None
    return JobTag(cls, gpus)
