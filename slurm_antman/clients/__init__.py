"""What the Prolog, the Epilog, the CLI and the views call to reach the two daemons: the node sidecar's
control socket (:mod:`.sidecar_control`) and the coordinator's query endpoint (:mod:`.coordinator_query`).
They speak slurm_antman.protocol and import neither daemon."""
