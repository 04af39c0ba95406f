"""slurm-antman: AntMan-style dynamic GPU sharing for Slurm clusters (cluster side)."""

__version__ = "0.1.0"
