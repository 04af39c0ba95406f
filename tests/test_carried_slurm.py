"""The carried Slurm of `make gpu-site-proof` (lab/devcluster/carried_slurm.py): Debian's Slurm and munge
packages with their libraries' packages, unpacked into a prefix on a machine that has no Slurm. The GPU
machine is such a machine; here a minimal Debian root without Slurm plays it (.ci/bare-root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_antman.lab.devcluster import carried_slurm as cs

REPO = Path(__file__).resolve().parent.parent
# The device call's carry (docs/gpu_proof.md): the tree, .site and .whl together.
DEVICE_CARRY_BYTES = 64 << 20


def test_unpacking_carries_only_the_libraries_the_machine_lacks(carried_bundle, tmp_path):
    manifest = json.loads((carried_bundle / "manifest.json").read_text())
    sonames = set(manifest["sonames"])
    assert {"libmunge.so.2", "liblua5.1.so.0", "libhwloc.so.15"} <= sonames, sonames
    assert not any(n.startswith(("libc.so", "libm.so", "ld-linux")) for n in sonames)
    lacking = cs.unpack(carried_bundle, tmp_path / "bare", known=set())
    assert sorted(p.name for p in lacking.lib.iterdir()) == sorted(sonames)
    having = cs.unpack(carried_bundle, tmp_path / "full", known=sonames)
    assert list(having.lib.iterdir()) == []
    # The daemons by their own names (Slurm tells slurmctld from slurmd by it), their wrappers on PATH.
    for name in ("slurmctld", "slurmd", "slurmstepd"):
        assert cs.daemon_program(having, name).name == name
        assert os.readlink(cs.daemon_program(having, name)) == f"{name}-wlm"
        assert (having.bin / name).read_text().count(str(having.lib)) == 1
    assert cs.missing_libraries(lacking) == {}


@pytest.mark.slow  # builds a Debian root once (about 30 s), then about 6 s
def test_the_carried_slurm_runs_jobs_in_a_root_without_slurm(carried_bundle, tmp_path):
    """munged, slurmctld and slurmd from the prefix, in a root that has none of them nor their libraries:
    a job step and a batch job run."""
    if subprocess.run([str(REPO / ".ci" / "bare-root"), "build"], capture_output=True).returncode:
        pytest.skip("the bare root cannot be built here (no Debian mirror or no mmdebstrap)")
    work = tmp_path / "bare"
    shutil.copytree(carried_bundle, work / "bundle")  # the root sees the checkout and this directory only
    r = subprocess.run([str(REPO / ".ci" / "bare-root"), "run", str(work),
                        f"! command -v slurmd && ! command -v sinfo && ! command -v munged && ! ldconfig -p | grep -q 'lua5.1\\|libmunge' "
                        f"&& python3 -m slurm_antman.lab.devcluster.carried_slurm selftest --bundle {work}/bundle "
                        f"--work {work}/run"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    seen = json.loads(r.stdout[r.stdout.index("{"):])
    assert seen["missing_libraries"] == {}
    assert seen["version"].startswith("slurm") and "22.05" in seen["version"]
    assert seen["sinfo"] == "idle"
    assert seen["srun"].startswith("step-ran ") and seen["batch"] == "batch-ran"


def test_what_travels_to_the_gpu_machine_fits_its_carry(carried_bundle):
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in tracked if f and (REPO / f.decode()).is_file())
    wheels = sum(p.stat().st_size for p in (REPO / ".whl").glob("*.whl")) if (REPO / ".whl").is_dir() else 0
    total = tree + cs.bundle_bytes(carried_bundle) + wheels
    assert total < DEVICE_CARRY_BYTES, f"tree {tree}, Slurm {cs.bundle_bytes(carried_bundle)}, wheels {wheels}"
