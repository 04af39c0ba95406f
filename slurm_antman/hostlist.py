"""Slurm hostlist expressions (``node[1-3,7]``), expanded without calling ``scontrol``.

The config is validated on machines that may not have Slurm installed (a laptop, CI), so the
expansion must not depend on ``scontrol show hostnames``.
"""

from __future__ import annotations

import re

from .errors import AntmanError

_BRACKET = re.compile(r"\[([^\]]*)\]")


class HostlistError(AntmanError, ValueError):
    pass


def expand(expr: str) -> list[str]:
    """Expand ``a[1-2],b`` into ``["a1", "a2", "b"]``, keeping zero padding (``n[01-02]``)."""
    names: list[str] = []
    for part in _split_top_level(expr):
        names.extend(_expand_one(part))
    if len(set(names)) != len(names):
        raise HostlistError(f"hostlist {expr!r} names a host twice")
    return names


def _split_top_level(expr: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in expr.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append("".join(cur))
    for p in parts:
        if not p:
            raise HostlistError(f"empty host name in hostlist {expr!r}")
    return parts


def _expand_one(part: str) -> list[str]:
    m = _BRACKET.search(part)
    if not m:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", part):
            raise HostlistError(f"invalid host name {part!r}")
        return [part]
    prefix, suffix = part[: m.start()], part[m.end():]
    out: list[str] = []
    for rng in m.group(1).split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"invalid range {rng!r} in {part!r}: expected N or N-M")
        width = len(lo)
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise HostlistError(f"range {rng!r} in {part!r} goes backwards")
        for i in range(a, b + 1):
            out.extend(_expand_one(f"{prefix}{i:0{width}d}{suffix}"))
    return out
