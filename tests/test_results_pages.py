"""The two results pages stay pages an admin reads in minutes: the current results on the first screen,
and a length that holds results and how to reproduce them, not their history (that is CHANGELOG.md's)."""

from __future__ import annotations

from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FIRST_SCREEN = 40  # lines: a terminal or a browser window without scrolling


@pytest.mark.parametrize("page, most", [("evaluation.md", 600), ("benchmarks.md", 500)])
def test_a_results_page_opens_on_its_results_and_stays_short(page, most):
    lines = (DOCS / page).read_text().splitlines()
    assert len(lines) < most, f"docs/{page} has {len(lines)} lines (fewer than {most}): move history to CHANGELOG.md"
    head = lines[:FIRST_SCREEN]
    table = [k for k, ln in enumerate(head) if ln.startswith("|---")]
    assert table, f"docs/{page}: no results table in its first {FIRST_SCREEN} lines"
    # A table of results, not of contents: its rows carry numbers and the date they were measured on.
    rows = []
    for ln in head[table[0] + 1:]:
        if not ln.startswith("|"):
            break
        rows.append(ln)
    assert rows and all(any(ch.isdigit() for ch in r) for r in rows)
    assert any("2026-" in ln for ln in head), f"docs/{page}: its first screen says when its results were measured"
