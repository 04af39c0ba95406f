"""Loads the agent into a job's PyTorch without any change to the training script.

``slurm_antman_torch_patch.pth`` (installed into site-packages with the package) runs one line at
interpreter start-up. Outside a slurm-antman job it only looks up two environment variables, so every
other Python process pays nothing. Inside a job (``ANTMAN_JOB_ID`` or ``ANTMAN_CLASS`` set) it puts a
tiny finder at the front of ``sys.meta_path`` that waits for ``import torch``; when torch has finished
importing, the agent starts, except in torchrun's own process (``torchrun``, ``python -m
torch.distributed.run``), which is no rank: its workers get theirs. Any agent error is written to
stderr and the job runs unpatched: ``import torch`` must never fail because of us.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import traceback
from types import ModuleType
from typing import Any, Optional, Sequence

ACTIVATION_ENV = ("ANTMAN_JOB_ID", "ANTMAN_CLASS")
# Set to 1 to keep the agent out of a job (debugging, or a script that calls install() itself).
DISABLE_ENV = "ANTMAN_AGENT_DISABLE"
# (directory, pyzmq builds it holds) when the agent came from a site's agent bundle (bundle_loader).
BUNDLE: Optional[tuple[str, list[str]]] = None


def wanted(environ: Optional[dict] = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    return any(env.get(k) for k in ACTIVATION_ENV)


def missing_zmq_line() -> str:
    """The one line a job reads when its Python cannot load the agent's one compiled dependency."""
    impl = sys.implementation
    where = f"{impl.name} {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable})"
    if BUNDLE is not None:
        got = ", ".join(BUNDLE[1]) or "none"
        why = (f"cannot import pyzmq and the site's agent bundle {BUNDLE[0]} has no build for {impl.cache_tag} "
               f"(it has: {got})")
    else:
        why = "cannot import pyzmq"
    return (f"slurm-antman: this job's Python, {where}, {why}; the job runs without the agent. "
            f"Add pyzmq to the job's environment (pip install pyzmq), or ask the site to add Python "
            f"{sys.version_info[0]}.{sys.version_info[1]} to the agent bundle.\n")


# torchrun's own process (the parent of the ranks) imports torch and trains nothing: an agent there
# would register as one more rank 0 that never reaches a boundary, so never acknowledges limits.
TORCHRUN_MAINS = ("torch/distributed/run.py", "torch/distributed/launch.py")


def is_torchrun(argv0: str) -> bool:
    path = argv0.replace(os.sep, "/")
    return os.path.basename(path) == "torchrun" or path.endswith(TORCHRUN_MAINS)


def _start_agent() -> None:
    if is_torchrun((getattr(sys, "argv", None) or [""])[0]):
        return
    try:
        from . import agent
    except ModuleNotFoundError as e:
        if e.name == "zmq":
            sys.stderr.write(missing_zmq_line())
            return
        raise
    agent.start_from_env()


def report_failure(what: str) -> None:
    try:
        sys.stderr.write(f"slurm-antman: {what}; the job runs without the agent\n{traceback.format_exc()}")
    except Exception:
        pass


class _AfterTorchLoader(importlib.abc.Loader):
    """Runs torch's own loader, then starts the agent."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        # Restore the real loader so that reload() and introspection see torch's own.
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        try:
            module.__loader__ = self._inner
        except AttributeError:
            pass
        try:
            _start_agent()
        except Exception:
            report_failure("could not start the agent")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TorchImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname != "torch":
            return None
        try:
            remove_hook()
            spec = None
            # The finders after us, in order, as the import system would ask them.
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if find is not None:
                    spec = find(fullname, path, target)
                    if spec is not None:
                        break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _AfterTorchLoader(spec.loader)
            return spec
        except Exception:
            report_failure("import hook failed")
            return None


_finder: Optional[TorchImportFinder] = None


def install_hook() -> None:
    """Called by the .pth line inside a job; starts the agent now if torch is already imported."""
    global _finder
    try:
        if not wanted():
            return
        if "torch" in sys.modules:
            _start_agent()
            return
        if _finder is None:
            _finder = TorchImportFinder()
            sys.meta_path.insert(0, _finder)
    except Exception:
        report_failure("could not install the import hook")


def remove_hook() -> None:
    global _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None
