"""The site configuration, ``antman.yaml``: its model (model.py) and its strict reader (loader.py).

Everything is imported from here (``from slurm_antman import config``; ``config.load(path)``,
``config.AntmanConfig``), so the split between the two files is this package's own business.
"""

from .loader import MAX_CONFIG_BYTES, MAX_CONFIG_NODES, ConfigError, load, parse
from .model import *  # noqa: F401,F403 - the model's classes and helpers are the package's API
