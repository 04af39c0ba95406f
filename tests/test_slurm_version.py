"""Which Slurm versions slurm-antman accepts, what differs between them, and the one-line refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_antman import config as cfgmod
from slurm_antman.admin import doctor
from slurm_antman.slurm import CliBackend, SlurmError
from slurm_antman.slurm import version as v

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text,want", [
    ("slurm-wlm 24.11.5\n", (24, 11, 5)),   # Debian's build
    ("slurm 22.05.8\n", (22, 5, 8)),        # upstream's
    ("24.11.5", (24, 11, 5)),
    ("slurm 23.02.10-1", (23, 2, 10)),
])
def test_parse_version(text, want):
    assert v.parse_version(text) == want


@pytest.mark.parametrize("text", ["", "slurm-wlm", "version 7.1", "scontrol: fatal: Could not establish a configuration source"])
def test_parse_version_refuses_text_without_one(text):
    with pytest.raises(SlurmError, match="cannot read a Slurm version"):
        v.parse_version(text)


@pytest.mark.parametrize("have", [(22, 5, 8), (24, 11, 5), (23, 2, 1), (23, 11, 10), (22, 5, 0), (24, 11, 99), (25, 11, 7), (26, 5, 5)])
def test_versions_in_the_range_are_accepted(have):
    assert v.check_supported(have) == have


@pytest.mark.parametrize("have", [(21, 8, 8), (22, 0, 1), (26, 6, 0), (27, 5, 0), (20, 11, 9)])
def test_a_version_outside_the_range_is_one_line_naming_it_and_the_supported_ones(have):
    with pytest.raises(v.UnsupportedSlurm) as e:
        v.check_supported(have)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"Slurm {v.fmt(have)} is not supported")
    assert "22.05" in msg and "26.05" in msg


def test_only_the_tested_versions_count_as_tested():
    assert v.is_tested((22, 5, 8)) and v.is_tested((24, 11, 1)) and v.is_tested((25, 11, 7)) and v.is_tested((26, 5, 5))
    assert not v.is_tested((23, 11, 4)) and not v.is_tested((23, 2, 0)) and not v.is_tested((25, 5, 2))


def test_what_differs_is_decided_by_version():
    assert v.cred_type_line((22, 5, 8)) == "CryptoType=crypto/munge"
    assert v.cred_type_line((23, 11, 0)) == v.cred_type_line((24, 11, 5)) == "CredType=cred/munge"
    assert v.nodes_argv((22, 5, 8)) == ["sinfo", "--json"]
    assert v.nodes_argv((24, 11, 5)) == ["scontrol", "show", "nodes", "--json"]


def _fake_slurm(tmp_path: Path, version_line: str) -> dict[str, str]:
    """A PATH whose slurmctld, slurmd and sinfo print ``version_line`` (and nothing else works)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("slurmctld", "slurmd", "sinfo"):
        f = bin_dir / name
        f.write_text(f"#!/bin/sh\necho '{version_line}'\n")
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


def test_installed_version_reads_the_commands_on_path(tmp_path):
    env = _fake_slurm(tmp_path, "slurm-wlm 24.11.5")
    assert v.installed_version(env) == (24, 11, 5)
    assert v.installed_version(env, commands=v.DAEMON_FIRST) == (24, 11, 5)


def test_adapter_refuses_an_unsupported_slurm_in_one_line(tmp_path):
    env = _fake_slurm(tmp_path, "slurm 26.11.1")
    with pytest.raises(v.UnsupportedSlurm, match=r"^Slurm 26\.11\.1 is not supported: .*22\.05.*26\.05"):
        CliBackend(env=env).nodes()


def test_devcluster_up_refuses_an_unsupported_slurm_in_one_line_and_starts_nothing(tmp_path):
    env = _fake_slurm(tmp_path, "slurm 21.08.8")
    env["PYTHONPATH"] = str(REPO)
    d = tmp_path / "dc"
    r = subprocess.run([sys.executable, "-m", "slurm_antman.cli", "devcluster", "up", "--dir", str(d),
                        "--no-accounting"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Slurm 21.08.8 is not supported" in lines[0] and "22.05" in lines[0] and "26.05" in lines[0]
    assert not (d / "etc" / "slurm.conf").exists() and not (d / "cluster.json").exists()


def test_doctor_fails_an_unsupported_slurm_and_warns_an_untested_one(tmp_path):
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "plugin_path": str(tmp_path / "none.so")})
    c = doctor.check_versions(cfg, {"SLURM_VERSION": "26.11.1"})
    assert c.status == "fail" and "Slurm 26.11.1 is not supported" in c.reason
    # In range: the plugin is read next (none here), so the range check did not stop it.
    c = doctor.check_versions(cfg, {"SLURM_VERSION": "23.11.4"})
    assert c.status == "fail" and "cannot load" in c.reason
