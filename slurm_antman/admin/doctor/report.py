"""How a check reads: ok, warn, fail or skip, a one-line reason and, for anything not ok, a hint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    reason: str
    hint: str = ""


def ok(name: str, reason: str) -> Check:
    return Check(name, "ok", reason)


def warn(name: str, reason: str, hint: str) -> Check:
    return Check(name, "warn", reason, hint)


def fail(name: str, reason: str, hint: str) -> Check:
    return Check(name, "fail", reason, hint)


def skip(name: str, reason: str) -> Check:
    return Check(name, "skip", reason)


_MARK = {"ok": "OK  ", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


def render_text(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    out = []
    for c in checks:
        out.append(f"{_MARK[c.status]}  {c.name:<{width}}  {c.reason}")
        if c.hint:
            out.append(f"      {'':<{width}}  hint: {c.hint}")
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    out.append(f"{failed} failed, {warned} warning(s), {sum(c.status == 'ok' for c in checks)} ok")
    return "\n".join(out) + "\n"
