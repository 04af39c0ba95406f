"""The agent bundle: what a job's own Python needs to load the agent, in one directory.

Most training runs in the user's own environment (a venv with torch, a conda environment, a
container image), which has never heard of slurm-antman. The SPANK plugin puts this directory first
on a managed job's PYTHONPATH (``agent_path=`` in plugstack.conf); its ``sitecustomize.py``
(torch_patch/bundle_loader.py) starts the agent when the job imports torch.

It holds the pure-Python packages ``torch_patch`` and ``slurm_antman`` (the agent's protocol; the
whole package, so that a job importing other parts of it is not handed a partial copy) and pyzmq,
the agent's one compiled dependency, once per interpreter ABI (``_zmq/cpython-311``, ...): the
installing Python's own build, plus builds for the Python versions the site names. A job whose
Python matches none of them and has no pyzmq of its own is told so in one line, and runs without
the agent.

A bundle is built beside its destination and swapped in with two renames, so a job starting during
an upgrade sees the old bundle or the new one, never half of each.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from slurm_antman.errors import AntmanError

MARKER = ".antman-agent-bundle"
ZMQ_DIR = "_zmq"
PACKAGES = ("torch_patch", "slurm_antman")
# manylinux tags pyzmq publishes for x86_64 and aarch64 (PEP 600 names and the older 2014 alias).
_PLATFORMS = {
    "x86_64": ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64"),
    "aarch64": ("manylinux_2_28_aarch64", "manylinux2014_aarch64", "manylinux_2_17_aarch64"),
}
_WHEEL_TAG = re.compile(r"^pyzmq-[^-]+-cp(\d)(\d+)-")
_VERSION = re.compile(r"^3\.(\d+)$")


class BundleError(AntmanError):
    pass


@dataclass
class Bundle:
    path: Path
    zmq_builds: list[str] = field(default_factory=list)


def _copy_package(name: str, dest: Path) -> None:

    src = Path(importlib.import_module(name).__file__).parent
    shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))


def _own_zmq(dest: Path) -> str:
    """Copies the running interpreter's pyzmq (with the libzmq its wheel bundles) into dest."""
    import zmq

    pkg = Path(zmq.__file__).parent
    tag = sys.implementation.cache_tag
    out = dest / ZMQ_DIR / tag
    out.mkdir(parents=True)
    shutil.copytree(pkg, out / "zmq", ignore=shutil.ignore_patterns("__pycache__"))
    libs = pkg.parent / "pyzmq.libs"  # auditwheel's vendored libzmq/libsodium, found by RPATH
    if libs.is_dir():
        shutil.copytree(libs, out / "pyzmq.libs")
    return tag


def _wheel_tag(wheel: Path) -> str:
    m = _WHEEL_TAG.match(wheel.name)
    if m is None or m.group(1) != "3":
        raise BundleError(f"{wheel}: not a CPython 3 pyzmq wheel (expected pyzmq-VERSION-cp3XY-...whl)")
    return f"cpython-3{m.group(2)}"


def _unpack_wheel(wheel: Path, dest: Path, tag: str) -> None:
    out = dest / ZMQ_DIR / tag
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            top = member.split("/", 1)[0]
            if top not in ("zmq", "pyzmq.libs"):
                continue
            target = (out / member).resolve()
            if not str(target).startswith(str(out.resolve()) + os.sep):
                raise BundleError(f"{wheel}: member {member!r} would land outside the bundle")
            z.extract(member, out)
            mode = (z.getinfo(member).external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode)


def _version_tag(version: str) -> str:
    m = _VERSION.match(version)
    if m is None:
        raise BundleError(f"--python {version!r}: expected a CPython 3 version such as 3.12")
    return f"cpython-3{m.group(1)}"


def download_zmq(version: str, into: Path) -> Path:
    """pip's wheel of pyzmq for CPython ``version`` (e.g. "3.12") and this machine's architecture."""
    _version_tag(version)
    import platform
    from importlib.metadata import version as dist_version

    platforms = _PLATFORMS.get(platform.machine())
    if platforms is None:
        raise BundleError(f"no pyzmq wheel platform known for {platform.machine()}; pass --zmq-wheel FILE")
    into.mkdir(parents=True, exist_ok=True)
    # The installed pyzmq's version first (one protocol build everywhere), then any release new
    # enough for the agent when that one has no wheel for this Python.
    for spec in (f"pyzmq=={dist_version('pyzmq')}", "pyzmq>=25"):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--implementation", "cp", "--python-version", version, "-d", str(into), spec]
        for p in platforms:
            cmd += ["--platform", p]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(into.glob("pyzmq-*.whl"))  # this version's own directory: only its wheel
        if r.returncode == 0 and wheels:
            return wheels[-1]
    raise BundleError(f"no pyzmq wheel for CPython {version} from pip ({r.stderr.strip().splitlines()[-1:]}); "
                      f"download one elsewhere and pass --zmq-wheel FILE")


def build(dest: Path, pythons: tuple[str, ...] = (), zmq_wheels: tuple[Path, ...] = ()) -> Bundle:
    """Builds the bundle at dest (replacing an earlier bundle there, never anything else)."""
    dest = Path(dest).absolute()
    if dest.exists() and not (dest / MARKER).is_file():
        raise BundleError(f"{dest} exists and is not an agent bundle: refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for name in PACKAGES:
            _copy_package(name, work)
        loader = Path(importlib.import_module("torch_patch").__file__).parent / "bundle_loader.py"
        shutil.copy2(loader, work / "sitecustomize.py")
        builds = {_own_zmq(work)}
        with tempfile.TemporaryDirectory() as dl:
            # (wheel, the ABI tag it serves): a downloaded wheel serves the version it was asked for
            # (an abi3 wheel would serve later ones too, but only asked-for versions are claimed).
            wheels = [(Path(w), _wheel_tag(Path(w))) for w in zmq_wheels]
            for v in pythons:
                tag = _version_tag(v)
                if tag not in builds and tag not in (t for _, t in wheels):
                    wheels.append((download_zmq(v, Path(dl) / v), tag))
            for w, tag in wheels:
                if tag in builds:  # the installing Python's own build is the tested one: keep it
                    continue
                _unpack_wheel(w, work, tag)
                builds.add(tag)
        from slurm_antman import __version__

        (work / MARKER).write_text(json.dumps({"version": __version__, "zmq_builds": sorted(builds)}) + "\n")
        # Readable by every job's user; written by root only.
        for root, dirs, files in os.walk(work):
            for n in dirs:
                os.chmod(os.path.join(root, n), 0o755)
            for n in files:
                p = os.path.join(root, n)
                os.chmod(p, 0o755 if os.stat(p).st_mode & 0o111 else 0o644)
        os.chmod(work, 0o755)
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.rename(dest, old)
        os.rename(work, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Bundle(dest, sorted(builds))


def read(dest: Path) -> dict:
    """The bundle's marker (version, pyzmq builds), for doctor; BundleError when dest is none."""
    try:
        return json.loads((Path(dest) / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"{dest}: no agent bundle ({e})") from None


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="antman agent-bundle",
        description="Build the agent bundle (antman.yaml agent_path) that the SPANK plugin puts on a managed "
                    "job's PYTHONPATH. Run it as root on every node after each install or upgrade.")
    p.add_argument("--out", required=True, type=Path, help="the bundle directory (antman.yaml agent_path)")
    p.add_argument("--python", action="append", default=[], metavar="3.X",
                   help="also carry pyzmq for this CPython version, downloaded with pip (repeatable); the "
                        "installing Python's own version is always carried")
    p.add_argument("--zmq-wheel", action="append", default=[], type=Path, metavar="FILE",
                   help="a pyzmq wheel to carry, for a site without access to a package index (repeatable)")
    a = p.parse_args(argv)
    try:
        b = build(a.out, tuple(a.python), tuple(a.zmq_wheel))
    except BundleError as e:
        print(f"antman agent-bundle: {e}", file=sys.stderr)
        return 1
    print(f"{b.path}: agent bundle for {', '.join(b.zmq_builds)}")
    return 0
