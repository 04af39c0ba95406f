"""Benchmarks that prove slurm-antman's mechanisms on real hardware.

Every ``antman bench PART`` lives here: the CPU parts (``control``, ``coordinator``, ``faults``,
``models``, ``pause``, ``simulate``, ``trace``, and ``trade``, which draws several ``simulate`` runs in
one picture) and ``antman bench gpu`` (``gpu.py``), which runs every
GPU mechanism once on a real GPU, each part (``gpu_*.py``) in a process of its own with its own time
budget, and writes ``gpu.json`` and ``gpu.md``.

Importing this package imports nothing else (``wheels.py`` must run where torch and pyzmq may be
missing).
"""
