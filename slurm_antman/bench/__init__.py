"""Benchmarks that prove slurm-antman's mechanisms on real hardware.

``antman bench gpu`` (``gpu.py``) runs every GPU mechanism once on a real GPU, each part in a process
of its own with its own time budget, and writes ``gpu.json`` and ``gpu.md``. The older
``slurm_antman/bench_*.py`` modules stay where they are; this package reuses them.

Importing this package imports nothing else (``wheels.py`` must run where torch and pyzmq may be
missing).
"""
