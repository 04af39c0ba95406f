"""Docs, code, tests and configuration cite dates, commits, docs sections and papers, not the numbers of
issues or work sessions: those mean nothing to a reader of a release, and they go stale. A file name
under docs/data/ may keep one (it is an identifier, and has no space before its number); docs/gpu_runs/
holds the GPU runs' reports as they were written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("docs", "slurm_antman", "torch_patch", "spank", "etc", "tests", ".ci")
FILES = ("README.md", "Makefile", "pyproject.toml")
LEFT_OUT = (ROOT / "docs" / "gpu_runs", ROOT / "docs" / "data")
SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = {".pyc", ".so", ".o", ".png"}

# A word, an optional plural s, one space, a number. Built from pieces so that this file does not match.
PATTERN = re.compile(r"\b(" + "ses" + "sion" + "|" + "is" + "sue" + r")s? [0-9]+", re.IGNORECASE)


def _text_files():
    paths = [ROOT / name for name in FILES if (ROOT / name).is_file()]
    for tree in TREES:
        base = ROOT / tree
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if not path.is_file() or path.suffix in SKIP_SUFFIXES:
                continue
            if SKIP_DIRS.intersection(path.relative_to(ROOT).parts):
                continue
            if any(path.is_relative_to(left) for left in LEFT_OUT):
                continue
            paths.append(path)
    for path in paths:
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        yield path, data.decode("utf-8", errors="replace")


def test_no_issue_or_session_numbers():
    found = []
    for path, text in _text_files():
        for number, line in enumerate(text.splitlines(), 1):
            for m in PATTERN.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r} in {line.strip()[:120]}")
    assert not found, ("cite a date, a commit, a docs section or a paper instead of an issue or session number:\n"
                       + "\n".join(found))


def test_the_pattern_finds_what_it_is_for():
    word_a, word_b = "Is" + "sue", "ses" + "sion"
    assert PATTERN.search(f"## {word_a} 29: moves for pace")
    assert PATTERN.search(f"(2026-11-26, {word_b} 22)")
    assert PATTERN.search(f"{word_b}s 20 and 22")
    assert not PATTERN.search(f"docs/data/{word_a.lower()}29-slots-per-gpu.json")
    assert not PATTERN.search(f"clusterdata {word_a.lower()} #125")
    assert not PATTERN.search(f"a {word_b}-wide setting")
