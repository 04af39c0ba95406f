"""``python -m slurm_antman.doctor``, as ``antman doctor``."""

import sys

from . import main

sys.exit(main())
