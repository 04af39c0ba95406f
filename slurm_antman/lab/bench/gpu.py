"""``antman bench gpu``: every GPU mechanism of slurm-antman, run once on a real GPU (docs/gpu_proof.md).

    antman bench gpu --out DIR [--plan] [--budget-s N] [--parts memory,spill,...]

One process tree: this runner starts each part in a process of its own (a new session, so a part's
own workers go with it), gives it a time budget, kills the whole group if it overruns, and records
what it left. A part that raises, crashes or overruns is recorded as such and the next part runs:
no part can lose another's results. ``DIR/gpu.json`` and ``DIR/gpu.md`` are rewritten after every
part (``gpu_report.py``), and each part's output goes to ``DIR/logs/PART.log``.

Where a part cannot run (no CUDA, no NVML, pyzmq missing, a feature not built yet) it is skipped with
a one-line reason before anything starts. ``--plan`` prints the parts, in order, with their budgets
and, where they would be skipped here, why.

The parts and what they prove are listed in ``PARTS``; docs/gpu_proof.md is the operator's page.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import slurm_antman
from slurm_antman.protocol import ENV_AGENT_DISABLE

from .gpu_part import PartContext, PartSkipped, read_json
from .gpu_report import FORMAT_VERSION, write_reports

PROG = "antman bench gpu"
# After its budget a part's process gets this long to write its record before it is killed.
KILL_GRACE_S = 10.0


class BenchGpuError(ValueError):
    """A bad flag: the message names the flag and what is allowed."""


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    budget_s: float     # default; --budget-s scales all of them down together
    target: str         # "module:function" run in the part's process with a PartContext
    needs: tuple[str, ...]
    what: str           # one line for --plan
    skip_if: Optional[Callable[[], Optional[str]]] = None  # a reason to skip, decided before starting


def _pause_missing() -> Optional[str]:
    from .gpu_pause import missing

    return missing()


_B = "slurm_antman.lab.bench."
# In docs/gpu_proof.md's order. The budgets add up to 465 s (the zoo gave 30 to pause; for slots, memory,
# spill, zoo and pause gave 60, from what they took on the H100 on 2026-11-26), so the run ends within 8 minutes on an
# H100 with room for the runner's own start-up; each includes its processes' start-up (torch import
# and CUDA context, 5-10 s per process).
PARTS: tuple[Part, ...] = (
    Part("memory", "Memory limit: shrink, grow, and changes while ResNet-50 trains", 25.0,
         _B + "gpu_memory:run", ("cuda", "zmq"),
         "shrink frees the cache and refuses a too-large allocation, grow admits it; limits sent over the "
         "protocol while zoo resnet50 trains, each applied at the next iteration"),
    Part("spill", "Spill to host: training under a limit below the footprint", 40.0,
         _B + "gpu_spill:run", ("cuda",),
         "resnet50 unspilled vs the same seed under a limit at half its footprint (host spill): losses, "
         "slowdown, NVML process memory against the limit"),
    Part("interference", "Throttle and interference, and the AIMD loop", 150.0,
         _B + "gpu_interference:run", ("cuda", "nvml", "zmq", "sidecar"),
         "guaranteed resnet50 beside an opportunistic resnet50 at shares 1, 0.5, 0.25, 0.1, 0.05, 0, at full "
         "and half guaranteed duty (the interference formula checked); then the real sidecar's AIMD loop"),
    Part("telemetry", "Telemetry: NVML against what the agents report", 30.0,
         _B + "gpu_telemetry:run", ("cuda", "nvml", "zmq", "sidecar"),
         "the real sidecar with NVML and two agents: GPU utilisation and per-process memory vs the reports"),
    Part("overhead", "Agent overhead on a real model alone", 45.0,
         _B + "gpu_overhead:run", ("cuda", "zmq"),
         "resnet50 with the agent attached vs detached, A-B-B-A rounds beside an A/A control"),
    Part("zoo", "The zoo: antman bench models --device cuda --pairs-with resnet50,lstm_lm", 60.0,
         _B + "gpu_zoo:run", ("cuda", "nvml"),
         "every zoo model alone and beside resnet50 and lstm_lm (bench.models, in chunks until the budget)"),
    Part("pause", "Pause and resume in place", 25.0, _B + "gpu_pause:run", ("cuda",),
         "an 8 GiB model+Adam state moved to pinned host memory and back: time against the measured "
         "host-device bandwidth, memory freed, losses against an unpaused twin",
         skip_if=_pause_missing),
    Part("slots", "Slot filling: the guaranteed job's idle slots, on a real GPU", 90.0, _B + "gpu_slots:run",
         ("cuda",),
         "guaranteed resnet50 at about half duty beside an opportunistic one: alone, the duty throttle at "
         "shares 0.05, 0.1 and 0.2, and slot filling; the fill efficiency and leak the simulator takes"),
)
BY_NAME = {p.name: p for p in PARTS}
DEFAULT_BUDGET_S = sum(p.budget_s for p in PARTS)

_WHEELS_HINT = "run `make gpu-wheels` where there is network and carry .whl/ (make gpu-proof installs it)"


# --- what this machine has ------------------------------------------------------------------------


def _need_cuda() -> Optional[str]:
    try:
        import torch
    except ImportError as e:
        return f"PyTorch missing: {e}"
    if not torch.cuda.is_available():
        return f"no CUDA device: torch.cuda.is_available() is false (torch {torch.__version__})"
    return None


def _need_nvml() -> Optional[str]:
    from slurm_antman.sidecar.telemetry import NvmlTelemetry, TelemetryError

    try:
        NvmlTelemetry().close()
    except TelemetryError as e:
        return f"NVML unavailable: {e}"
    return None


def _need_modules(*modules: str) -> Callable[[], Optional[str]]:
    def check() -> Optional[str]:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        return f"Python module(s) {', '.join(missing)} missing: {_WHEELS_HINT}" if missing else None
    return check


NEEDS: dict[str, Callable[[], Optional[str]]] = {
    "cuda": _need_cuda,
    "nvml": _need_nvml,
    "zmq": _need_modules("zmq"),
    # slurm_antman.sidecar.daemon imports the config model (antman.yaml): PyYAML and pydantic.
    "sidecar": _need_modules("zmq", "yaml", "pydantic"),
}


class Requirements:
    """Each need checked once per run (NVML's init is not free)."""

    def __init__(self, needs: Optional[dict[str, Callable[[], Optional[str]]]] = None) -> None:
        self._needs = NEEDS if needs is None else needs
        self._seen: dict[str, Optional[str]] = {}

    def skip_reason(self, part: Part) -> Optional[str]:
        # A feature not built yet is the reason everywhere, ahead of what this machine lacks.
        reason = part.skip_if() if part.skip_if is not None else None
        if reason is not None:
            return reason
        for need in part.needs:
            if need not in self._seen:
                self._seen[need] = self._needs[need]()
            if self._seen[need] is not None:
                return self._seen[need]
        return None


# --- flags ----------------------------------------------------------------------------------------


def select_parts(text: Optional[str]) -> list[Part]:
    if text is None or text.strip() == "all":
        return list(PARTS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BY_NAME]
    if bad or not names:
        raise BenchGpuError(f"--parts {text!r}: unknown part(s) {', '.join(bad) or '(none given)'}; allowed: "
                            f"{', '.join(BY_NAME)} or 'all', comma-separated")
    return [p for p in PARTS if p.name in names]  # always in docs/gpu_proof.md's order


def budgets(parts: Sequence[Part], total_s: Optional[float]) -> list[float]:
    """Each part's budget: its default, all scaled down together when ``total_s`` is less than their sum
    (never up: a part's default is what it needs)."""
    want = sum(p.budget_s for p in parts)
    scale = 1.0 if total_s is None or want <= total_s or want == 0 else total_s / want
    return [round(p.budget_s * scale, 1) for p in parts]


def plan(parts: Sequence[Part], part_budgets: Sequence[float], req: Optional[Requirements] = None) -> str:
    lines = [f"{PROG}: plan, {len(parts)} part(s) in this order, {sum(part_budgets):.0f} s in all, "
             "each in a process of its own:"]
    for i, (p, b) in enumerate(zip(parts, part_budgets), 1):
        reason = req.skip_reason(p) if req is not None else None
        lines.append(f"{i:>2}. {p.name:<13}{b:>6.0f} s  {p.what}")
        if reason:
            lines.append(f"{'':>4}{'':<13}{'':>8}would skip here: {reason}")
    return "\n".join(lines)


# --- the runner -----------------------------------------------------------------------------------


def environment() -> dict:
    """What the proof ran on, without creating a CUDA context in the runner (NVML names the GPU)."""
    env: dict = {"python": platform.python_version(), "host": socket.gethostname(), "gpu": None,
                 "driver": None, "torch": None, "cuda": None}
    try:
        import torch

        env["torch"], env["cuda"] = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            drv = pynvml.nvmlSystemGetDriverVersion()
            env["gpu"] = name.decode() if isinstance(name, bytes) else name
            env["driver"] = drv.decode() if isinstance(drv, bytes) else drv
            env["gpu_count"] = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py, no driver: the environment just says none
        pass
    return env


def _child_env() -> dict:
    # The directory that holds the slurm_antman package, for the child processes' imports.
    root = os.path.dirname(os.path.dirname(os.path.abspath(slurm_antman.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
    # The parts build their agents themselves; the import hook must not start another one.
    env[ENV_AGENT_DISABLE] = "1"
    # CUDA's device 0 is then NVML's GPU 0 (CUDA's default order is fastest first).
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def run_part(part: Part, budget_s: float, out_dir: str) -> dict:
    """Runs one part in its own process group; returns its record with status and reason."""
    logs, work = os.path.join(out_dir, "logs"), os.path.join(out_dir, "work", part.name)
    os.makedirs(logs, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    record_path = os.path.join(out_dir, "work", f"{part.name}.json")
    log_path = os.path.join(logs, f"{part.name}.log")
    try:
        os.unlink(record_path)
    except FileNotFoundError:
        pass
    cmd = [sys.executable, "-m", "slurm_antman.lab.bench.gpu", "--run-part", part.name, "--target", part.target,
           "--part-budget-s", repr(budget_s), "--record", record_path, "--workdir", work]
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=_child_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s + KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.wait()
        finally:
            _kill_group(proc)  # workers the part left behind
    rec = read_json(record_path) or {"results": {}, "checks": [], "summary": []}
    rec.update(name=part.name, title=part.title, budget_s=budget_s,
               elapsed_s=round(time.monotonic() - t0, 2), log=os.path.relpath(log_path, out_dir))
    rec["status"], rec["reason"] = _status(rec, rc, timed_out, budget_s, log_path)
    return rec


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the part's own session: its pid is the group id
    except (ProcessLookupError, PermissionError):
        pass


def _status(rec: dict, rc: int, timed_out: bool, budget_s: float, log_path: str) -> tuple[str, str]:
    failed = [c["name"] for c in rec.get("checks", []) if not c.get("ok")]
    if timed_out:
        return "timeout", (f"killed after its budget of {budget_s:.0f} s (+{KILL_GRACE_S:.0f} s grace); what it "
                           f"recorded until then is kept" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if rec.get("skipped"):
        return "skipped", rec["skipped"]
    if rec.get("error"):
        return "error", rec["error"].strip().splitlines()[-1]
    if rc != 0:
        return "error", f"its process exited with {rc} before finishing; last output: {_tail(log_path)}"
    if not rec.get("done"):
        return "error", "its process ended without finishing its record"
    if failed:
        return "failed", f"check(s) not met: {', '.join(failed)}"
    return "passed", ""


def _tail(path: str, n: int = 300) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    return " ".join(text[-n:].split()) or "(empty log)"


def run_all(parts: Sequence[Part], part_budgets: Sequence[float], out_dir: str, command: str,
            req: Optional[Requirements] = None, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
            ) -> dict:
    req = req or Requirements()
    t0 = time.monotonic()
    doc = {"format": FORMAT_VERSION, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": command, "environment": environment(), "budget_s": sum(part_budgets),
           "elapsed_s": 0.0, "complete": False, "parts": []}
    write_reports(doc, out_dir)
    for part, budget in zip(parts, part_budgets):
        reason = req.skip_reason(part)
        if reason is not None:
            rec = {"name": part.name, "title": part.title, "status": "skipped", "reason": reason,
                   "budget_s": budget, "elapsed_s": 0.0, "checks": [], "results": {}, "summary": []}
        else:
            log(f"{PROG}: {part.name} (budget {budget:.0f} s) ...")
            rec = run_part(part, budget, out_dir)
        log(f"{PROG}: {part.name}: {rec['status']}" + (f": {rec['reason']}" if rec["reason"] else ""))
        doc["parts"].append(rec)
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_reports(doc, out_dir)
    doc["complete"] = True
    write_reports(doc, out_dir)
    return doc


# --- a part's own process -------------------------------------------------------------------------


def part_main(name: str, target: str, budget_s: float, record: str, workdir: str) -> int:
    ctx = PartContext(name, budget_s, record, workdir)
    try:
        module, _, fn = target.partition(":")
        getattr(importlib.import_module(module), fn)(ctx)
    except PartSkipped as e:
        ctx.finish(skipped=str(e), done=True)
        return 0
    except BaseException:  # noqa: BLE001 - the record must say what broke, whatever it was
        ctx.finish(error=traceback.format_exc())
        traceback.print_exc()
        return 1
    ctx.finish(done=True)
    return 0


# --- command line ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for gpu.json, gpu.md and the parts' logs (required unless --plan)")
    p.add_argument("--plan", action="store_true", help="print what would run, in order, with budgets; run nothing")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"total seconds for all selected parts (default: their sum, {DEFAULT_BUDGET_S:.0f} s for "
                        "all); less scales every part's budget down")
    p.add_argument("--parts", help=f"comma-separated subset of: {', '.join(BY_NAME)} (default: all)")
    # Shown, not hidden: whoever finds one in `ps` can look it up.
    p.add_argument("--run-part", metavar="PART",
                   help="internal, passed by the parent to each part's own process: run only this part")
    p.add_argument("--target", metavar="MODULE:FUNCTION", help="internal (with --run-part): the part's function")
    p.add_argument("--part-budget-s", type=float, help="internal (with --run-part): the part's seconds")
    p.add_argument("--record", metavar="FILE", help="internal (with --run-part): where the part writes its record")
    p.add_argument("--workdir", metavar="DIR", help="internal (with --run-part): the part's scratch directory")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.run_part:
        return part_main(a.run_part, a.target, a.part_budget_s, a.record, a.workdir)
    try:
        if a.budget_s is not None and not a.budget_s > 0:
            raise BenchGpuError(f"--budget-s {a.budget_s:g}: must be a positive number of seconds")
        parts = select_parts(a.parts)
        if not a.plan and not a.out:
            raise BenchGpuError("--out DIR is required (where gpu.json and gpu.md go), unless --plan")
    except BenchGpuError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    part_budgets = budgets(parts, a.budget_s)
    req = Requirements()
    if a.plan:
        print(plan(parts, part_budgets, req))
        return 0
    command = "antman bench gpu " + " ".join(shlex.quote(x) for x in argv)
    doc = run_all(parts, part_budgets, a.out, command, req)
    counts = {s: sum(1 for p in doc["parts"] if p["status"] == s) for s in ("passed", "failed", "error",
                                                                              "timeout", "skipped")}
    print(f"{PROG}: wrote {os.path.join(a.out, 'gpu.json')} and gpu.md in {doc['elapsed_s']:.0f} s: "
          + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    # A part that could not run here is not a failure of the command; a broken one is.
    return 1 if counts["failed"] or counts["error"] or counts["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
