"""The whole product on one real GPU under Slurm (`make gpu-site-proof`): Slurm carried to a bare machine,
the site proof run and its report (docs/gpu_proof.md)."""
