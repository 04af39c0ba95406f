"""The agent bundle's ``sitecustomize.py``: loads the agent into a job's own Python.

``antman agent-bundle`` copies this file, as ``sitecustomize.py``, into a directory that also
holds the pure-Python packages the agent needs and pyzmq builds per Python (``_zmq/<cache_tag>``).
The SPANK plugin (``agent_path=`` in plugstack.conf) puts that directory first on a managed job's
PYTHONPATH, so a venv with torch and nothing else, a conda environment, or a container with the
directory mounted gets the agent with no change to the job.

Python imports the first ``sitecustomize`` on sys.path, and PYTHONPATH comes before the
interpreter's own directories, so this file shadows the environment's own sitecustomize (Debian's,
conda's): it runs that one too, first, as if it had not been shadowed. Nothing here may fail the
interpreter's start: every error is written to stderr in one line and the job goes on.
"""

import os
import sys


def _run_shadowed() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    later, seen = [], False
    for entry in sys.path:
        if seen:
            later.append(entry)
        elif os.path.abspath(entry or os.curdir) == here:
            seen = True
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _load_agent() -> None:
    if not (os.environ.get("ANTMAN_JOB_ID") or os.environ.get("ANTMAN_CLASS")):
        return
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    builds = os.path.join(here, "_zmq")
    if importlib.util.find_spec("zmq") is None:
        # The environment's own pyzmq wins when it has one; otherwise the bundle's build for this
        # exact interpreter ABI, if the site made one.
        own = os.path.join(builds, sys.implementation.cache_tag)
        if os.path.isdir(own):
            sys.path.append(own)
    import torch_patch.activation as activation

    activation.BUNDLE = (here, sorted(os.listdir(builds)) if os.path.isdir(builds) else [])
    activation.install_hook()


for _step in (_run_shadowed, _load_agent):
    try:
        _step()
    except Exception as _e:  # noqa: BLE001 - the interpreter must start whatever happens here
        try:
            sys.stderr.write(f"slurm-antman: agent bundle {__file__}: {_step.__name__}: {_e!r}\n")
        except Exception:
            pass
del _step
