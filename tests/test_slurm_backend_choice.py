"""Which Slurm backend a long-lived reader gets (antman.yaml's slurm.backend). pyslurm is built for one Slurm
release only; where the pyslurm importable here is missing or built for another release, ``auto`` keeps the
CLI and ``pyslurm`` refuses with the reason. The pyslurm path itself is measured and compared record by record
on a Slurm 25.11 cluster by ``antman bench slurm-backend`` (docs/benchmarks.md, "The Slurm adapter")."""

from __future__ import annotations

import importlib.util

import pytest

from slurm_antman import config as cfgmod
from slurm_antman.slurm import SlurmError
from slurm_antman.slurm.cli_backend import CliBackend
from slurm_antman.slurm.pyslurm_backend import available, long_lived_backend

HAVE_PYSLURM = importlib.util.find_spec("pyslurm") is not None


@pytest.mark.skipif(HAVE_PYSLURM, reason="pyslurm is installed here: the case without it cannot be shown")
def test_without_pyslurm_auto_is_the_cli_and_pyslurm_says_why():
    assert available((25, 11, 7)).startswith("pyslurm is not installed")
    assert type(long_lived_backend(choice="auto")) is CliBackend
    assert type(long_lived_backend(choice="cli")) is CliBackend
    with pytest.raises(SlurmError, match=r"^slurm.backend is pyslurm, but pyslurm is not installed"):
        long_lived_backend(choice="pyslurm")


def test_the_choice_is_checked_where_the_site_writes_it():
    assert cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}]}).slurm.backend == "auto"
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.parse({"nodes": [{"name": "n1", "gpus": 1}], "slurm": {"backend": "pyslurm2"}})
    assert "slurm.backend" in str(e.value) and "'auto', 'cli' or 'pyslurm'" in str(e.value)
