"""What `antman squeue` and `antman nodes` show: Slurm's view of jobs and nodes joined with the
node sidecars' live numbers, as tables or JSON."""
