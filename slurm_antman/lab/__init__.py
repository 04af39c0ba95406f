"""The lab: what develops, demonstrates and measures slurm-antman and is not needed on a site's nodes:
the local multi-node Slurm cluster (:mod:`.devcluster`), the demo, the job scripts they run
(``jobs/``), the benchmarks (:mod:`.bench`) and the trace evaluation (:mod:`.evaluation`). Product code
never imports it; it may run Slurm commands itself."""
