"""Every command-line flag and argument of slurm-antman has help: `antman`'s own parser with all
its subcommands, and every other parser in slurm_antman/ and slurm_antman/sidecar/ (the daemons, keys, doctor, the
benchmarks, the bench workers). The parsers are found in the source, so a new one is checked too."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parser_builders() -> list[tuple[str, str]]:
    """(module, top-level function) for every function that makes an ArgumentParser."""
    found = []
    for root in ("slurm_antman", "sidecar"):
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for fn in tree.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                if any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) ==
                       "ArgumentParser" for n in ast.walk(fn)):
                    found.append((module, fn.name))
    return found


BUILDERS = _parser_builders()


def _build(module: str, name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser the function makes: returned (a ``_parser()``) or caught when the function asks it to
    parse (a ``main(argv)``), before anything else of the function runs."""
    def caught(self, *args, **kwargs):
        raise _Built(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    fn = getattr(importlib.import_module(module), name)
    takes_argv = bool(inspect.signature(fn).parameters)
    try:
        out = fn([]) if takes_argv else fn()
    except _Built as b:
        return b.parser
    assert isinstance(out, argparse.ArgumentParser), f"{module}.{name} neither returned nor parsed a parser"
    return out


def _missing_help(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            described = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not described.get(name):
                    missing.append(f"{prog} {name} (the subcommand)")
                missing += _missing_help(sub, f"{prog} {name}")
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_the_parsers_are_found():
    # The antman command, a passthrough daemon and a bench module at least: the search itself works.
    assert {("slurm_antman.cli", "build_parser"), ("slurm_antman.sidecar.cli", "_parser"),
            ("slurm_antman.lab.bench.submit", "main")} <= set(BUILDERS)
    assert len(BUILDERS) >= 15, BUILDERS


@pytest.mark.parametrize("module, name", BUILDERS, ids=[f"{m}.{n}" for m, n in BUILDERS])
def test_every_argument_has_help(module, name, monkeypatch):
    parser = _build(module, name, monkeypatch)
    assert _missing_help(parser, parser.prog) == []


def test_antman_subcommands_are_walked(monkeypatch):
    from slurm_antman import cli

    parser = cli.build_parser()
    # The walk reaches the subcommands' own arguments: one left without help is reported.
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["devcluster"].add_argument("--undocumented")
    assert _missing_help(parser, "antman") == ["antman devcluster --undocumented"]
