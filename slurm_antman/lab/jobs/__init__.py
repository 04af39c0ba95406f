"""The job scripts the demo, the devcluster tests and the benchmarks submit: ``demo_train.py`` (a
checkpointing training loop), ``demo_guaranteed.py`` and ``gpu_hog.py`` (a job that ignores its limits)."""

from pathlib import Path


def script(name: str) -> Path:
    """The path of one of these scripts, to hand to sbatch or a subprocess."""
    path = Path(__file__).with_name(name)
    if not path.is_file():
        raise FileNotFoundError(f"no lab job script named {name!r} in {path.parent}")
    return path
