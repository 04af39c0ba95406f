"""The pure policy cores, shared by the daemons and the trace simulator (no I/O, no clock, no Slurm, no
ZeroMQ): :mod:`.cluster` is the coordinator's (quotas, classes, opportunistic slots, preemption),
:mod:`.node` the sidecar's (memory limits, compute shares, GPU choice, compliance). :mod:`.progress` is
the interference model both use."""
