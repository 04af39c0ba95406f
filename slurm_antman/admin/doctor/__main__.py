"""``python -m slurm_antman.admin.doctor``, as ``antman doctor``."""

import sys

from . import main

sys.exit(main())
