"""Errors every part of slurm-antman raises, so the CLI can print one clear line for each."""


class AntmanError(Exception):
    """Base of the errors the CLI reports as a message rather than a traceback."""
