"""The Python packages an offline GPU node lacks, carried as wheels in ``.whl/`` (docs/gpu_proof.md).

The GPU node has torch (2.11, CUDA 13), nvidia-ml-py and pytest on Python 3.12, x86-64, and no network.
What the proof's code paths import beyond that (checked by importing ``torch_patch.agent`` and
``slurm_antman.sidecar.daemon`` with each package blocked):

- pyzmq: the agent-to-sidecar protocol (``torch_patch.client``, ``slurm_antman.sidecar.daemon``);
- PyYAML and pydantic (with pydantic-core, annotated-types, typing-inspection, typing-extensions):
  ``slurm_antman.sidecar.daemon`` imports the config model (``slurm_antman.config``) through ``slurm_antman.sidecar.uplink``.

rich and prometheus-client are not imported on these paths. The versions are the ones in the
development venv, so the GPU run uses what the tests ran with.

``python -m slurm_antman.lab.bench.wheels list`` prints ``name==version`` for ``make gpu-wheels`` to download;
``... install --wheels .whl --target .whl/site`` installs, with ``pip install --no-index``, those whose
module is missing or older than the carried wheel, into a directory that goes on PYTHONPATH (nothing
of the node's own Python is touched, no root needed).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Callable, Optional, Sequence

# distribution name -> the module it provides
CARRIED: dict[str, str] = {
    "pyzmq": "zmq",
    "PyYAML": "yaml",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic_core",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "typing_extensions": "typing_extensions",
}


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def version_tuple(v: str) -> tuple[int, ...]:
    """Numeric release parts ("6.0.3" -> (6, 0, 3)); enough for these packages' plain versions."""
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def pins(version_of: Callable[[str], str] = importlib.metadata.version) -> list[str]:
    """``name==version`` of every carried package, from this environment."""
    return [f"{d}=={version_of(d)}" for d in CARRIED]


def carried_wheels(wheel_dir: str) -> dict[str, tuple[str, str]]:
    """normalised distribution name -> (wheel path, version) found in ``wheel_dir``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))):
        name, version = os.path.basename(path).split("-")[:2]
        out[_key(name)] = (path, version)
    return out


def needed(wheels: dict[str, tuple[str, str]], installed: Callable[[str], Optional[str]]) -> list[str]:
    """Wheel paths to install: a carried package whose distribution is missing here, or older than the
    wheel (pydantic pins its pydantic-core exactly; an old typing-extensions lacks what pydantic uses).
    ``installed(dist)`` is the version here, or None."""
    paths = []
    for dist in CARRIED:
        have = installed(dist)
        wheel = wheels.get(_key(dist))
        if wheel is None:
            continue
        if have is None or version_tuple(have) < version_tuple(wheel[1]):
            paths.append(wheel[0])
    return paths


def missing_wheels(wheels: dict[str, tuple[str, str]], installed: Callable[[str], Optional[str]]) -> list[str]:
    """Carried packages missing here with no wheel for them either: the run would skip parts."""
    return [d for d in CARRIED if installed(d) is None and _key(d) not in wheels]


def installed_version(dist: str, target: Optional[str] = None) -> Optional[str]:
    """The version of ``dist`` importable here, ``target`` (where ``install`` puts wheels) first."""
    path = ([target] if target else []) + sys.path
    for d in importlib.metadata.distributions(name=dist, path=path):
        return d.version
    return None


def install_command(paths: Sequence[str], target: str) -> list[str]:
    # --no-index: the node is offline; --no-deps: the dependencies are the carried wheels themselves.
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
            "--quiet", "--target", target, *paths]


def install(wheel_dir: str, target: str, run: Callable[[list[str]], int] = lambda c: subprocess.call(c)) -> int:
    wheels = carried_wheels(wheel_dir)
    paths = needed(wheels, lambda d: installed_version(d, target))
    for d in missing_wheels(wheels, lambda d: installed_version(d, target)):
        print(f"gpu wheels: {d} is missing and {wheel_dir}/ has no wheel for it: run `make gpu-wheels` "
              "where there is network; the parts that need it will be skipped", file=sys.stderr)
    if not paths:
        print("gpu wheels: nothing to install", file=sys.stderr)
        return 0
    os.makedirs(target, exist_ok=True)
    print(f"gpu wheels: installing {', '.join(os.path.basename(p) for p in paths)} into {target}", file=sys.stderr)
    return run(install_command(paths, target))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_antman.lab.bench.wheels",
                                 description="carry the Python packages an offline GPU node lacks")
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="name==version of each carried package, from this environment")
    ins = sub.add_parser("install", help="pip install --no-index what is missing here from the carried wheels")
    ins.add_argument("--wheels", default=".whl", help="directory of carried wheels (default .whl)")
    ins.add_argument("--target", default=".whl/site", help="install into this directory (put it on PYTHONPATH)")
    a = ap.parse_args(argv)
    if a.action == "list":
        print("\n".join(pins()))
        return 0
    return install(a.wheels, a.target)


if __name__ == "__main__":
    sys.exit(main())
