"""The Slurm adapter: one interface (:class:`SlurmBackend`), a CLI implementation, typed errors."""

from .backend import SlurmBackend
from .cli_backend import CliBackend, default_backend
from .errors import (CommandFailed, JobEnded, JobNotFound, SlurmError, SlurmOutputError, SlurmUnavailable,
                     SubmissionRejected, WaitTimeout)
from .models import ANTMAN_CLASSES, AntmanTag, Job, Node

__all__ = [
    "SlurmBackend", "CliBackend", "default_backend", "Job", "Node", "AntmanTag", "ANTMAN_CLASSES",
    "SlurmError", "JobNotFound", "SubmissionRejected", "SlurmUnavailable", "CommandFailed",
    "SlurmOutputError", "WaitTimeout", "JobEnded",
]
