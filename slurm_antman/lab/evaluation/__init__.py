"""Evaluation: real cluster traces, a workload model for their jobs, and a discrete-event simulator
that drives the production policy code (``slurm_antman.policy.node.core`` and ``slurm_antman.policy.cluster``)."""
