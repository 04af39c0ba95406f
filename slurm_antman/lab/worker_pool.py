"""Benchmark workers run side by side: processes started together, each answering ``ready`` once
loaded, all released by one line on stdin at the same moment, each ending with its result as the
last line of its stdout (JSON). The bench models (``lab.bench.models``) and the contending emulated
GPU's pairs (``lab.evaluation.contended_bench``) measure jobs beside each other this way."""

from __future__ import annotations

import json
import subprocess
from typing import Callable, Sequence


def run_released(cmds: Sequence[list[str]], names: Sequence[str], env: dict, go_line: str, timeout_s: float,
                 error: Callable[[str], Exception]) -> list[dict]:
    """Start ``cmds`` (one worker each), wait for every ``ready``, send ``go_line`` to all, and return
    their JSON results in order. ``error(text)`` makes the exception raised for a worker that does not
    start or fails; every worker still running is killed on the way out."""
    procs: list[subprocess.Popen] = []
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
        for n, p in zip(names, procs):
            line = p.stdout.readline().strip()
            if line != "ready":
                p.kill()
                raise error(f"worker {n} did not start: {line!r}; stderr: {p.stderr.read()[-2000:]}")
        for p in procs:  # released within a millisecond of each other
            p.stdin.write(go_line + "\n")
            p.stdin.flush()
        out = []
        for n, p in zip(names, procs):
            stdout, stderr = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise error(f"worker {n} exited {p.returncode}: {stderr[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
