"""The node's pure policy: per-job memory limits and compute shares (:mod:`.core`), which GPU backs an
opportunistic slot (:mod:`.placement`) and whether a job keeps to its limits (:mod:`.compliance`). The
sidecar measures and enforces; this decides."""
