"""The admin's commands: rendering the Slurm fragments from ``antman.yaml`` (:mod:`.render`), merging a
site's own slurm.conf (:mod:`.site_settings`), the configuration reference (:mod:`.config_reference`), the
agent bundle a job's own Python loads (:mod:`.agent_bundle`) and ``antman doctor`` (:mod:`.doctor`)."""
