"""A real multi-node Slurm cluster on loopback (or network namespaces): slurmctld, several slurmd, munge,
optionally slurmdbd and MariaDB (:mod:`.cluster`, :mod:`.accounting`), its state directory
(:mod:`.dirs`) and the helpers that submit and watch its jobs (:mod:`.jobs`)."""
