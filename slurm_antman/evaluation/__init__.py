"""Evaluation: real cluster traces, a workload model for their jobs, and a discrete-event simulator
that drives the production policy code (``sidecar.local_policy`` and ``slurm_antman.policy``)."""
