"""--antman-elastic=MIN:MAX in sbatch, salloc and srun (the SPANK plugin's allocator and local
contexts), without a cluster: a bad value fails the command before it contacts slurmctld; a good one
reaches the submit request as ANTMAN_ELASTIC in the job control env. The fixtures (a private build of
the plugin, a minimal slurm.conf, a loopback stand-in for slurmctld) are test_spank_build.py's."""

from __future__ import annotations

import pytest

from test_spank_build import (  # noqa: F401 - fixtures
    FakeController,
    _run,
    _unused_port,
    munged,
    needs_slurm_clients,
    plugin,
    pytestmark,
    slurm_conf,
)

ALLOWED = "allowed: MIN:MAX, two whole numbers (no sign, spaces or leading zero) with 1 <= MIN <= MAX <= 64"


def _argv(cmd: str, *opts: str) -> list[str]:
    return [cmd, *opts] + (["--wrap", "true"] if cmd == "sbatch" else ["true"])


@needs_slurm_clients
def test_help_lists_the_option(slurm_conf) -> None:
    env = slurm_conf(_unused_port())
    for cmd in ("sbatch", "salloc", "srun"):
        res = _run([cmd, "--help"], env=env)
        assert res.returncode == 0, f"{cmd} --help: {res.stderr}"
        flat = " ".join(res.stdout.split())
        assert "--antman-elastic=MIN:MAX" in flat, f"{cmd} --help does not list --antman-elastic"
        assert "slurm-antman elastic width of an opportunistic job" in flat
        assert "or of a job array's nodes (MAX = tasks x GPUs per task)" in flat


# Every command for one value; the values' rule itself is test_contracts.py's (the C harness).
BAD = [("sbatch", v) for v in ("0:1", "1:65", "2", "01:2", "a:b", "")] + [(c, "3:2") for c in ("sbatch", "salloc", "srun")]


@needs_slurm_clients
@pytest.mark.parametrize(("cmd", "value"), BAD)
def test_bad_value_is_rejected_before_submission(slurm_conf, cmd: str, value: str) -> None:
    env = slurm_conf(_unused_port())
    res = _run(_argv(cmd, "--antman=opportunistic", f"--antman-elastic={value}"), env=env)
    assert res.returncode != 0
    assert f"--antman-elastic: invalid value '{value}'; {ALLOWED}" in res.stderr
    assert "Unable to contact" not in res.stderr  # the plugin refused it, not the absent controller


@needs_slurm_clients
def test_control_bytes_are_shown_escaped(slurm_conf) -> None:
    env = slurm_conf(_unused_port())
    res = _run(_argv("sbatch", "--antman-elastic=1:2\x1b[0m"), env=env)
    assert res.returncode != 0
    assert "invalid value '1:2\\x1b[0m'" in res.stderr
    assert "\x1b" not in res.stderr.split("Invalid --antman-elastic argument")[0]


@needs_slurm_clients
@pytest.mark.parametrize("value", ["1:2"])
def test_valid_value_reaches_the_submit_request(slurm_conf, munged, value: str) -> None:
    ctld = FakeController()
    try:
        env = slurm_conf(ctld.port)
        res = _run(["sbatch", "--antman=opportunistic", f"--antman-elastic={value}", "--wrap", "true"], env=env)
    finally:
        ctld.close()
    assert res.returncode != 0  # the stand-in never answers
    assert "Invalid --antman" not in res.stderr
    assert f"ANTMAN_ELASTIC={value}".encode() in ctld.received, "job control env lacks ANTMAN_ELASTIC"
    assert b"ANTMAN_CLASS=opportunistic" in ctld.received


@needs_slurm_clients
def test_the_plugin_alone_does_not_judge_the_class(slurm_conf, munged) -> None:
    """Without --antman the value still goes to the controller: job_submit.lua refuses it there,
    naming the rule, for this client and for any other that sets the env itself."""
    ctld = FakeController()
    try:
        env = slurm_conf(ctld.port)
        _run(["sbatch", "--antman-elastic=1:2", "--wrap", "true"], env=env)
    finally:
        ctld.close()
    assert b"ANTMAN_ELASTIC=1:2" in ctld.received
    assert b"ANTMAN_CLASS" not in ctld.received


@needs_slurm_clients
def test_no_option_sets_no_elastic(slurm_conf, munged) -> None:
    ctld = FakeController()
    try:
        env = slurm_conf(ctld.port)
        _run(["sbatch", "--antman=opportunistic", "--wrap", "true"], env=env)
    finally:
        ctld.close()
    assert b"#!/bin/sh" in ctld.received, "sbatch did not get as far as sending the job"
    assert b"ANTMAN_ELASTIC" not in ctld.received


@needs_slurm_clients
def test_docs_user_md_shows_the_message_sbatch_prints(slurm_conf) -> None:
    from test_spank_build import REPO

    env = slurm_conf(_unused_port())
    res = _run(_argv("sbatch", "--antman=opportunistic", "--antman-elastic=3:2"), env=env)
    printed = next(line for line in res.stderr.splitlines() if "--antman-elastic: invalid value" in line)
    message = printed[printed.index("--antman-elastic: invalid value"):]
    assert f"| `--antman-elastic=3:2` | `{message}` (" in (REPO / "docs" / "user.md").read_text()
