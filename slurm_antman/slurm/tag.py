"""The slurm-antman tag as Slurm's readers see it: ``slurm_antman.jobtag`` parses it, this only makes
that reading tolerant.

A listing must not stop at one odd job, so where ``jobtag.parse_tag`` raises for a damaged tag this
returns class "none" with the reason in ``problem`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..jobtag import PREFIX, JobTag, TagError, parse_tag

# What Slurm prints for an unset AdminComment (scontrol "(null)", some JSON "N/A"/"None").
_UNSET = (None, "(null)", "N/A", "None")


@dataclass
class AntmanTag:
    """The tag in AdminComment (``antman:class=CLASS[;gpus=...]``, docs/architecture.md), read leniently."""

    job_class: str = "none"
    gpus_by_node: dict[str, list[int]] = field(default_factory=dict)
    problem: Optional[str] = None  # why a present tag could not be read
    tag: Optional[JobTag] = None   # jobtag's reading; None when untagged or damaged

    def checked(self) -> Optional[JobTag]:
        """The tag, None when there is none; TagError (jobtag's message) when it is damaged."""
        if self.problem is not None:
            raise TagError(self.problem)
        return self.tag


def read_admin_comment(text: Optional[str]) -> AntmanTag:
    # Not stripped: the contract (docs/protocol.md) makes " antman:..." no tag, for every reader alike.
    text = "" if text in _UNSET else text
    try:
        tag = parse_tag(text)
    except TagError as e:
        return AntmanTag(job_class=_class_of_damaged(text), problem=str(e))
    if tag is None:
        return AntmanTag()
    return AntmanTag(tag.job_class, {n: list(g) for n, g in tag.gpus.items()}, None, tag)


def _class_of_damaged(text: str) -> str:
    """A tag whose class is sound but whose other fields (GPU entries, req, hold) are damaged keeps its
    class: the coordinator and the views have always treated such a job by the class Slurm's
    job_submit gave it. jobtag raises for the whole tag, so its class is read alone, by jobtag."""
    parts = [p.partition("=") for p in text[len(PREFIX):].split(";")]
    if not all(sep for _, sep, _ in parts):
        return "none"
    classes = [v for k, _, v in parts if k == "class"]
    try:
        alone = parse_tag(f"{PREFIX}class={classes[-1]}") if classes else None
    except TagError:
        return "none"
    return alone.job_class if alone is not None else "none"
