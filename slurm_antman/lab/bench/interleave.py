"""``antman bench interleave``: a guaranteed job with input stalls and an opportunistic job on one
contending emulated GPU, in the same run, three ways:

- ``alone``: each job by itself, the baselines (the guaranteed job's mini-batch time, the
  opportunistic job's work per second);
- ``duty``: both, the opportunistic job under the agent's duty throttle (``torch_patch.throttle``,
  launch mode), its share set by the node policy's AIMD loop (``policy.node.core.decide``, the
  sidecar's own code) from the guaranteed job's measured mini-batch times;
- ``slots``: the same, plus slot filling: the guaranteed job publishes its phases on an idle-slot page
  (``torch_patch.slots.SlotPublisher``) and the opportunistic job launches only into its idle slots
  (``SlotGate``), the AIMD loop still above it as the safety net.

It prints ``guaranteed_slowdown`` (mini-batch time over alone) and ``opportunistic_progress`` (work
per second over alone) per mode, measured over the last ``MEASURE_FRACTION`` of each window (the loop
starts at the policy's initial share and needs a few reports to settle). Targets: slot
filling at guaranteed slowdown <= 1.02 with opportunistic progress >= 5x the duty throttle's.

The device is ``contended_gpu``'s: one job's kernels at a time, FIFO, non-preemptive, with its
assumed 0.1 ms switch. The jobs are sleeps on it: nothing here is a GPU measurement.

    antman bench interleave [--window-s 20] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

PROG = "antman bench interleave"
MODES = ("alone", "duty", "slots")
MEASURE_FRACTION = 0.6
# The controller feeds the policy the mean mini-batch time since its last report, this often: the
# sidecar runs its policy on each agent report, which comes every 0.05 s or more (torch_patch/agent.py
# report_interval_s), so for these ~0.1 s mini-batches it sees about one mini-batch per report too.
REPORT_S = 0.1
READY_TIMEOUT_S = 60.0
NODE = "n1"


class BenchError(RuntimeError):
    pass


# --- workers ------------------------------------------------------------------------------------------


def _read_share(path: str, last: float) -> float:
    try:
        with open(path) as f:
            return float(f.read().strip() or last)
    except (OSError, ValueError):
        return last


def worker(a: argparse.Namespace) -> dict:
    from slurm_antman.lab.evaluation.contended_gpu import ContendedDevice, Sleeper
    from slurm_antman.lab.evaluation.emulated_job import _launch_class
    from torch_patch.slots import SlotGate, SlotPublisher
    from torch_patch.throttle import Throttle

    rng = random.Random(a.seed)
    sleep = Sleeper()
    guaranteed = a.worker == "guaranteed"
    with ContendedDevice(a.root, NODE, [0], a.worker, switch_s=a.switch_ms / 1e3, inflight=4,
                         idle_s=30.0) as dev:
        launch = _launch_class()(dev)  # a kernel launch as a module call: the hooks see it
        pub = gate = throttle = None
        if guaranteed and a.mode == "slots":
            pub = SlotPublisher(a.page)
        if not guaranteed:
            throttle = Throttle(mode="launch", synchronize=dev.synchronize)
            if a.mode == "slots":
                gate = SlotGate(a.page, synchronize=dev.synchronize, hurry=throttle.hurry_event)
                throttle.set_gate(gate)
        kernel_s = (a.g_kernel_ms if guaranteed else a.o_kernel_ms) / 1e3
        gpu_s = (a.g_gpu_ms if guaranteed else a.o_gpu_ms) / 1e3
        n_kernels = max(1, round(gpu_s / kernel_s))
        stall_mean = a.g_stall_ms / 1e3 if guaranteed else a.o_host_ms / 1e3
        jitter = a.g_stall_jitter if guaranteed else 0.0
        times = open(a.times, "w") if a.times else None
        share = 1.0
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise BenchError("the parent did not say go")
        t0 = time.monotonic()
        end = t0 + a.window_s
        measure_from = t0 + a.window_s * (1.0 - MEASURE_FRACTION)
        n, work, first, last = 0, 0.0, None, None
        stalled = busy = 0.0
        prev = t0
        while True:
            if throttle is not None and a.share_file:
                new = _read_share(a.share_file, share)
                if new != share:
                    share = new
                    throttle.set_share(share)
            # Input stall (guaranteed: drawn, so the slots vary as a data loader's do) or host work.
            stall = rng.uniform(stall_mean * (1.0 - jitter), stall_mean * (1.0 + jitter))
            sleep(stall)
            t_busy = time.monotonic()
            for _ in range(n_kernels):
                launch(kernel_s)
            dev.synchronize()  # loss.item()
            if pub is not None:
                pub.boundary()
            if throttle is not None:
                throttle.end_iteration()
            now = time.monotonic()
            if times is not None:  # the mini-batch and its device phase, as an agent on a GPU reports them
                times.write(f"{(now - prev) * 1e3:.3f} {(now - t_busy) * 1e3:.3f}\n")
                times.flush()
            prev = now
            if now >= measure_from:
                if first is None:
                    first = now
                else:
                    n += 1
                    work += n_kernels * kernel_s
                    stalled += stall
                    busy += now - t_busy
                    last = now
            if now >= end:
                break
        out = {"worker": a.worker, "mode": a.mode, "iterations": n}
        if n == 0 or last is None or first is None or last <= first:
            out.update(iter_ms=None, work_per_s=0.0)
        else:
            out.update(iter_ms=(last - first) / n * 1e3, work_per_s=work / (last - first),
                       stall_ms=stalled / n * 1e3, busy_ms=busy / n * 1e3)
        if throttle is not None:
            out.update(duty_cycle=throttle.duty_cycle(), final_share=share)
            throttle.close()
        if gate is not None:
            out.update(gate_waited_s=gate.waited_s, gate_launches=gate.launches, gate_blind=gate.blind,
                       work_estimate_ms=gate.work_ns / 1e6)
            gate.close()
        if pub is not None:
            pub.close()
        out["device_pid"] = dev.server_pids[0]
        if times is not None:
            times.close()
        return out


# --- the controller: the sidecar's AIMD loop on the guaranteed job's measured times -------------------


class Controller(threading.Thread):
    """Feeds the guaranteed job's mini-batch times (its worker's times file) to the node policy every
    ``REPORT_S`` and writes the opportunistic job's share where its worker reads it."""

    def __init__(self, times_path: str, share_path: str, solo_ms: float, solo_busy_ms: float) -> None:
        super().__init__(daemon=True)
        from slurm_antman.policy.node import core as lp

        self.lp = lp
        self.params = lp.NodePolicyParams()
        self.times_path, self.share_path = times_path, share_path
        self.stop_evt = threading.Event()
        self.shares: list[float] = []
        self._g = lp.JobInfo("g", "guaranteed", (0,), 0.0, 0)
        self._o = lp.JobInfo("o", "opportunistic", (0,), 1.0, 0)
        self._info = (lp.GpuInfo(0, 1 << 50),)
        # The solo baseline, as the sidecar learns it before the opportunistic job arrives.
        self.state = lp.measured_alone(replace(self._g, iteration_ms=solo_ms, busy_ms=solo_busy_ms), self._info[0],
                                       self.params)
        self._write(self.params.initial_share)

    def _write(self, share: float) -> None:
        tmp = self.share_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(repr(share))
        os.replace(tmp, self.share_path)
        self.shares.append(share)

    def run(self) -> None:
        lp = self.lp
        offset, it = 0, 0
        while not self.stop_evt.wait(REPORT_S):
            try:
                with open(self.times_path) as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            lines = chunk.split("\n")
            done = lines[:-1]  # the last piece may be a line still being written
            offset += sum(len(x) + 1 for x in done)
            vals = [tuple(map(float, x.split())) for x in done if x]
            if not vals:
                continue
            it += len(vals)
            g = replace(self._g, iteration=it, iteration_ms=sum(v[0] for v in vals) / len(vals),
                        busy_ms=sum(v[1] for v in vals) / len(vals))
            d = lp.decide(lp.NodeSnapshot(self._info, (g, self._o)), self.state, self.params, time.monotonic())
            self.state = d.state
            self._write(d.limits["o"].compute_share)


# --- the parent -----------------------------------------------------------------------------------------


def _cmd(a: argparse.Namespace, who: str, mode: str, root: str, page: str, times: str, share: str,
         window_s: float, seed: int) -> list[str]:
    return [sys.executable, "-m", "slurm_antman.lab.bench.interleave", "--worker", who, "--mode", mode,
            "--root", root, "--page", page, "--times", times, "--share-file", share,
            "--window-s", repr(window_s), "--seed", str(seed), "--switch-ms", repr(a.switch_ms),
            "--g-stall-jitter", repr(a.g_stall_jitter),
            "--g-gpu-ms", repr(a.g_gpu_ms), "--g-kernel-ms", repr(a.g_kernel_ms),
            "--g-stall-ms", repr(a.g_stall_ms), "--o-gpu-ms", repr(a.o_gpu_ms),
            "--o-kernel-ms", repr(a.o_kernel_ms), "--o-host-ms", repr(a.o_host_ms)]


def _run(a: argparse.Namespace, root: str, who: Sequence[str], mode: str, run_no: int,
         solo: Optional[dict], pids: set) -> dict[str, dict]:
    from slurm_antman.lab.evaluation.contended_gpu import _package_root
    from slurm_antman.lab.worker_pool import run_released
    from slurm_antman.protocol import ENV_AGENT_DISABLE, slot_page as sp

    d = os.path.join(root, f"run{run_no}")
    os.makedirs(d)
    page = os.path.join(d, "gpu0.slots")
    sp.create(page)
    times = {w: os.path.join(d, f"{w}.times") for w in who}
    share = os.path.join(d, "share")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (_package_root(), env.get("PYTHONPATH")) if x)
    env[ENV_AGENT_DISABLE] = "1"  # the workers build their throttle, gate and publisher themselves
    ctl = None
    fixed = a.duty_share if mode == "duty" else None
    if fixed is not None:
        with open(share, "w") as f:
            f.write(repr(fixed))
    elif "opportunistic" in who and "guaranteed" in who:
        ctl = Controller(times["guaranteed"], share, solo["iter_ms"], solo["busy_ms"])
    # One seed per job across the modes: the guaranteed job draws the same stalls in each.
    cmds = [_cmd(a, w, mode, os.path.join(root, "dev"), page, times[w], share if ctl or fixed else "",
                 a.window_s, a.seed * 2 + (w == "opportunistic")) for w in who]
    if ctl is not None:
        ctl.start()
    try:
        res = run_released(cmds, list(who), env, "go", a.window_s + READY_TIMEOUT_S, BenchError)
    finally:
        if ctl is not None:
            ctl.stop_evt.set()
            ctl.join(5)
    out = {r["worker"]: r for r in res}
    for r in res:
        pids.add(r.pop("device_pid"))
    if ctl is not None:
        tail = ctl.shares[-max(1, int(len(ctl.shares) * MEASURE_FRACTION)):]
        out["opportunistic"]["mean_share"] = sum(tail) / len(tail)
    elif fixed is not None:
        out["opportunistic"]["mean_share"] = fixed
    return out


def measure(a: argparse.Namespace, log=lambda s: print(s, file=sys.stderr)) -> dict:
    root = tempfile.mkdtemp(prefix="antman-interleave-")
    os.makedirs(os.path.join(root, "dev"))
    pids: set = set()
    doc: dict[str, Any] = {
        "what": "guaranteed job with input stalls + opportunistic job on one contending emulated GPU",
        "date_unix": time.time(), "window_s": a.window_s, "switch_ms": a.switch_ms,
        "guaranteed": {"gpu_ms": a.g_gpu_ms, "kernel_ms": a.g_kernel_ms, "stall_mean_ms": a.g_stall_ms},
        "opportunistic": {"gpu_ms": a.o_gpu_ms, "kernel_ms": a.o_kernel_ms, "host_ms": a.o_host_ms},
        "duty_share": a.duty_share, "modes": {}}
    try:
        log(f"{PROG}: each job alone ...")
        g_alone = _run(a, root, ("guaranteed",), "alone", 0, None, pids)["guaranteed"]
        o_alone = _run(a, root, ("opportunistic",), "alone", 1, None, pids)["opportunistic"]
        if not g_alone["iter_ms"] or not o_alone["work_per_s"]:
            raise BenchError("a job completed no measured mini-batch alone: raise --window-s")
        doc["modes"]["alone"] = {"guaranteed": g_alone, "opportunistic": o_alone,
                                 "guaranteed_slowdown": 1.0, "opportunistic_progress": 1.0}
        for i, mode in enumerate(("duty", "slots")):
            log(f"{PROG}: both, {mode} ...")
            r = _run(a, root, ("guaranteed", "opportunistic"), mode, 2 + i, g_alone, pids)
            g, o = r["guaranteed"], r["opportunistic"]
            # The stalls a run drew are its own: its mini-batch against the same stalls with the device
            # work as long as alone.
            doc["modes"][mode] = {
                "guaranteed": g, "opportunistic": o,
                "guaranteed_slowdown": ((g["stall_ms"] + g["busy_ms"]) / (g["stall_ms"] + g_alone["busy_ms"])
                                        if g["iter_ms"] else None),
                "opportunistic_progress": o["work_per_s"] / o_alone["work_per_s"]}
        duty, slots = doc["modes"]["duty"], doc["modes"]["slots"]
        ratio = (slots["opportunistic_progress"] / duty["opportunistic_progress"]
                 if duty["opportunistic_progress"] > 0 else None)
        doc["targets"] = {
            "slots_guaranteed_slowdown_le_1.02": bool(slots["guaranteed_slowdown"] is not None
                                                      and slots["guaranteed_slowdown"] <= 1.02),
            "slots_progress_over_duty": ratio,
            "slots_progress_ge_5x_duty": bool(ratio is not None and ratio >= 5.0)}
        return doc
    finally:
        from slurm_antman.lab.evaluation.contended_gpu import stop_devices

        stop_devices(pids, root)


def table(doc: dict) -> str:
    lines = [f"{'mode':6}  {'guaranteed_slowdown':>19}  {'opportunistic_progress':>22}  {'mean share':>10}"]
    for mode in MODES:
        m = doc["modes"][mode]
        gs = m["guaranteed_slowdown"]
        share = m["opportunistic"].get("mean_share")
        lines.append(f"{mode:6}  {gs if gs is None else f'{gs:.3f}':>19}  {m['opportunistic_progress']:>22.3f}  "
                     f"{'' if share is None else f'{share:.3f}':>10}")
    t = doc["targets"]
    r = t["slots_progress_over_duty"]
    lines.append(f"targets: slots guaranteed slowdown <= 1.02: {'met' if t['slots_guaranteed_slowdown_le_1.02'] else 'MISSED'}; "
                 f"slots progress / duty's = {'n/a' if r is None else f'{r:.1f}'}x (>= 5x: "
                 f"{'met' if t['slots_progress_ge_5x_duty'] else 'MISSED'})")
    return "\n".join(lines)


def _positive(name: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not v > 0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {text!r}")
        return v
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--window-s", type=_positive("--window-s"), default=20.0,
                   help="seconds each mode runs (default %(default)s); the last 60%% is measured")
    p.add_argument("--switch-ms", type=float, default=0.1, help="the device's context switch (assumed; default %(default)s)")
    p.add_argument("--g-gpu-ms", type=_positive("--g-gpu-ms"), default=50.0,
                   help="the guaranteed job's device work per mini-batch (default %(default)s)")
    p.add_argument("--g-kernel-ms", type=_positive("--g-kernel-ms"), default=5.0,
                   help="its kernels' length (default %(default)s)")
    p.add_argument("--g-stall-ms", type=_positive("--g-stall-ms"), default=50.0,
                   help="its mean input stall per mini-batch (default %(default)s: duty 0.5)")
    p.add_argument("--g-stall-jitter", type=float, default=0.2,
                   help="each stall is drawn from mean x [1 - J, 1 + J] (default %(default)s; 1: from [0, 2 x mean])")
    p.add_argument("--o-gpu-ms", type=_positive("--o-gpu-ms"), default=40.0,
                   help="the opportunistic job's device work per mini-batch (default %(default)s)")
    p.add_argument("--o-kernel-ms", type=_positive("--o-kernel-ms"), default=2.0,
                   help="its kernels' (modules') length (default %(default)s)")
    p.add_argument("--o-host-ms", type=float, default=1.0, help="its host time per mini-batch (default %(default)s)")
    p.add_argument("--duty-share", type=_positive("--duty-share"), default=None,
                   help="run the duty mode at this fixed share instead of under the AIMD loop (to find the "
                        "largest share that holds the guaranteed job within 2 %%)")
    p.add_argument("--seed", type=int, default=1, help="seed of the stalls the jobs draw (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", help="also write the JSON here")
    # worker side
    p.add_argument("--worker", choices=("guaranteed", "opportunistic"), help="internal: run one job")
    p.add_argument("--mode", choices=MODES, help="internal (with --worker)")
    p.add_argument("--root", help="internal (with --worker): the device's board directory")
    p.add_argument("--page", help="internal (with --worker): the idle-slot page")
    p.add_argument("--times", help="internal (with --worker): where the job writes each mini-batch's times")
    p.add_argument("--share-file", default="", help="internal (with --worker): where it reads its share")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)), flush=True)
        return 0
    if a.duty_share is not None and a.duty_share > 1.0:
        print(f"{PROG}: --duty-share must be in (0, 1], got {a.duty_share}", file=sys.stderr)
        return 2
    if not (0.0 <= a.g_stall_jitter <= 1.0):
        print(f"{PROG}: --g-stall-jitter must be in [0, 1], got {a.g_stall_jitter}", file=sys.stderr)
        return 2
    if not (0.0 <= a.switch_ms <= 1000.0):
        print(f"{PROG}: --switch-ms must be in [0, 1000], got {a.switch_ms}", file=sys.stderr)
        return 2
    try:
        doc = measure(a)
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1) if a.json else table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
