"""Where the local dev cluster lives unless told otherwise: one directory for `antman devcluster`,
`antman demo` and `make demo`, so that each finds the cluster another left running (`--keep`).
A module of its own so that building the CLI's parser does not import the devcluster."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("ANTMAN_DEVCLUSTER_DIR", "/tmp/antman-devcluster"))
