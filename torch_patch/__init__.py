"""slurm-antman's in-job agent for PyTorch.

In a slurm-antman job it loads itself when the script imports torch (see ``activation``); nothing in
the training script has to change. The public API is for scripts that want more:

``install()``
    start the agent explicitly (e.g. with ``ANTMAN_AGENT_DISABLE=1`` and your own arguments).
``step()``
    mark the end of a mini-batch in a custom loop. Without it, every ``optimizer.step()`` is a
    boundary; once ``step()`` is called, optimizer steps are no longer counted.
``on_preempt(fn)``
    ``fn(notice)`` is called once when the sidecar announces that the job will be preempted
    (``notice.deadline_unix``, ``notice.grace_s``, ``notice.reason``): save a checkpoint there. It
    runs in the training thread at the next boundary, or from the agent's thread if no boundary
    comes within half the remaining grace time. Slurm also sends the job's ``--signal`` on
    preemption (``SlurmctldParameters=preempt_send_user_signal``); this hook usually comes first.
    Under the elastic launcher (``python -m torch_patch.elastic_launch``, docs/elastic.md) the same
    hooks run on local rank 0 before a width change, in the training thread at a boundary, with
    ``notice.width`` set to the GPU list the job restarts on (``None`` for a preemption) and
    ``notice.grace_s`` 0: every worker is stopped as soon as the hooks return, and the new ones must
    load that checkpoint at start.

Importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# The agent is released with slurm-antman: one version for both (the sidecar reads it in register).
from slurm_antman import __version__

__all__ = ["install", "uninstall", "step", "on_preempt", "current", "__version__"]


def install(**kwargs: Any) -> Any:
    from . import agent

    return agent.install(**kwargs)


def uninstall() -> None:
    from . import agent

    agent.uninstall()


def current() -> Optional[Any]:
    import sys

    mod = sys.modules.get(__name__ + ".agent")
    return mod.current() if mod is not None else None


def step() -> None:
    """End of one mini-batch (custom training loops). A no-op when no agent runs."""
    a = current()
    if a is not None:
        a.step()


def on_preempt(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """Registers a checkpoint hook; usable as a decorator. Starts the agent if it is not running."""
    a = current() or install()
    a.on_preempt(fn)
    return fn
