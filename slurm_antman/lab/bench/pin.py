"""``antman bench pin``: a pause's host memory pinned fresh against kept (or pinned ahead), on this machine.

The offload of a pause (torch_patch.pause) copies a job's state into one host arena
(torch_patch.pinned). Fresh, the arena's pages must first be faulted in, which the kernel does by zeroing
them: on the H200 VM about 20 GiB/s with 8 threads (2026-11-26), which made a first pause 3.1-10.8x the
copies alone. An arena kept from the last pause, or pinned ahead once the sidecar granted room
(limits.pin_bytes), has its pages already. This runs that path on the CPU, side by side in one process:
``copy_out`` of a state of ``--gib`` GiB into a fresh arena and into a kept one, ``--rounds`` times each,
alternating. Registering with CUDA (``cudaHostRegister``) needs a GPU; here a stand-in runtime accepts
every chunk at once, so what is measured is the faulting and the copies, the part the kernel's zeroing
costs. On a GPU, `make gpu-proof` part 7 measures the whole of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional, Sequence


class _NoRegistration:
    """cudaSetDevice / cudaHostRegister / cudaHostUnregister that accept at once (no CUDA here)."""

    def cudaSetDevice(self, dev: int) -> int:
        return 0

    def cudaHostRegister(self, addr: int, n: int, flags: int) -> int:
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        return 0


def _state(torch, gib: float) -> list:
    """A training state's tensors: a parameter, its gradient and Adam's two moments per layer, 16 layers."""
    per = int(gib * (1 << 30) / 4 / 4 / 16)
    return [torch.randn(per) for _ in range(64)]


def measure(gib: float, rounds: int, threads: Optional[int] = None) -> dict:
    import torch

    from torch_patch import pinned

    rt = _NoRegistration()
    src = _state(torch, gib)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    fresh, kept_s, ahead_s = [], [], []
    kept = None
    for _ in range(rounds):
        timings: dict = {}
        t = time.perf_counter()
        hosts, arena = pinned.copy_out(torch, src, rt=rt, device=0, fallback=lambda x: x.clone(), sync=lambda: None,
                                       timings=timings, threads=threads)
        fresh.append(time.perf_counter() - t)
        assert not timings["kept_arena"] and all(torch.equal(h, s) for h, s in zip(hosts[:2], src[:2]))
        del hosts
        arena.release()
        if kept is None:  # pinned ahead, as after a grant: waited for here, timed apart
            t = time.perf_counter()
            kept = pinned.prepin(torch, pinned.align_up(nbytes * 9 // 8, pinned.CHUNK_BYTES), rt=rt, device=0,
                                 threads=threads)
            kept.finish()
            ahead_s.append(time.perf_counter() - t)
        timings = {}
        t = time.perf_counter()
        hosts, kept = pinned.copy_out(torch, src, rt=rt, device=0, fallback=lambda x: x.clone(), sync=lambda: None,
                                      timings=timings, threads=threads, kept=kept)
        kept_s.append(time.perf_counter() - t)
        assert timings["kept_arena"] and all(torch.equal(h, s) for h, s in zip(hosts[:2], src[:2]))
        del hosts
    kept.release()
    return {"bytes": nbytes, "rounds": rounds, "threads": threads or pinned.threads_default(),
            "fresh_s": fresh, "kept_s": kept_s, "prepin_s": ahead_s,
            "fresh_median_s": statistics.median(fresh), "kept_median_s": statistics.median(kept_s),
            "fresh_gib_s": nbytes / (1 << 30) / statistics.median(fresh),
            "kept_gib_s": nbytes / (1 << 30) / statistics.median(kept_s)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="antman bench pin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="the state's size in GiB (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="copies into each kind of arena, alternating (default 5)")
    ap.add_argument("--threads", type=int, help="faulting threads (default: the pause's, up to 8)")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON")
    a = ap.parse_args(argv)
    if not 0 < a.gib <= 64 or a.rounds < 1:
        ap.error("--gib must be in (0, 64] and --rounds at least 1")
    r = measure(a.gib, a.rounds, a.threads)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"state {r['bytes'] / (1 << 30):.2f} GiB, {r['threads']} faulting thread(s), {r['rounds']} rounds each:")
        print(f"  fresh arena : median {r['fresh_median_s'] * 1000:7.1f} ms  ({r['fresh_gib_s']:.1f} GiB/s)")
        print(f"  kept arena  : median {r['kept_median_s'] * 1000:7.1f} ms  ({r['kept_gib_s']:.1f} GiB/s)  "
              f"x{r['fresh_median_s'] / r['kept_median_s']:.2f} faster")
        print(f"  pinning ahead took {r['prepin_s'][0] * 1000:.1f} ms once (beside training, in a job)")
    return 0
