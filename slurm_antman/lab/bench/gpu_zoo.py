"""Part 6: ``antman bench models --device cuda --pairs-with resnet50,lstm_lm``, within the budget.

The command is run as it is (``models.main``), in chunks of profiles, each chunk with its own
``--out`` file, so that what finished is kept when the budget runs out: first ResNet-50 and the LSTM
among themselves, then the other profiles ``CHUNK`` at a time, while the time a chunk took so far says
the next one fits. Short windows (``WINDOW_S``) keep all ten profiles near two minutes on an H100;
``antman bench models`` run on its own uses 10 s windows for the numbers docs/workload_model.md takes.
"""

from __future__ import annotations

import contextlib
import io
import os
import time

from .gpu_part import PartContext, read_json

PARTNERS = ("resnet50", "lstm_lm")
CHUNK = 3
WINDOW_S, WARMUP = 2.0, 3


def chunks() -> list[list[str]]:
    from slurm_antman.lab.evaluation.model_zoo import NAMES

    rest = [n for n in NAMES if n not in PARTNERS]
    return [list(PARTNERS)] + [rest[i:i + CHUNK] for i in range(0, len(rest), CHUNK)]


def runs_in(chunk: list[str]) -> int:
    """Worker runs of one chunk: a solo per profile and partner, a pair per profile and partner (a
    partner's pair with itself or the other partner once)."""
    solos = len(set(chunk) | set(PARTNERS))
    pairs = len({frozenset((n, m)) for n in chunk for m in PARTNERS})
    return solos + pairs


def merge(docs: list[dict]) -> dict:
    out: dict = {"profiles": {}, "pairs": []}
    for d in docs:
        for k, v in d.items():
            if k not in ("profiles", "pairs"):
                out.setdefault(k, v)
        out["profiles"].update(d.get("profiles", {}))
        out["pairs"] += d.get("pairs", [])
    return out


def run(ctx: PartContext) -> None:
    from . import models as bench_models

    docs, per_run_s, skipped = [], None, []
    for i, chunk in enumerate(chunks()):
        need = runs_in(chunk) * per_run_s if per_run_s else 0.0
        if ctx.left() < need + 5:
            skipped += chunk
            continue
        path = os.path.join(ctx.workdir, f"chunk{i}.json")
        argv = ["--device", "cuda", "--profiles", ",".join(chunk), "--pairs-with", ",".join(PARTNERS),
                "--window-s", str(WINDOW_S), "--warmup", str(WARMUP), "--out", path]
        t0 = time.monotonic()
        with contextlib.redirect_stdout(io.StringIO()):  # its table; the part writes its own from the JSON
            rc = bench_models.main(argv)
        took = time.monotonic() - t0
        per_run_s = max(per_run_s or 0.0, took / runs_in(chunk))
        doc = read_json(path)
        if rc != 0 or doc is None:
            ctx.check(f"chunk {','.join(chunk)}", False, f"exit {rc}", "antman bench models exits 0")
            continue
        docs.append(doc)
        ctx.put("bench.models", merge(docs))
        ctx.put("command", "antman bench models " + " ".join(argv[:-2]))
    merged = ctx.put("bench.models", merge(docs))
    ctx.put("not_run_for_budget", skipped)
    timed = [n for n, r in merged["profiles"].items() if "solo" in r]
    # What the budget left out is reported, not failed: the command's own runs are what is checked.
    ctx.check("resnet50 and lstm_lm timed, alone and in pairs", all(n in timed for n in PARTNERS)
              and len(merged["pairs"]) >= 3, {"profiles timed": len(timed), "pairs": len(merged["pairs"])},
              "the partners' solos and their three pairs")
    if skipped:
        ctx.note(f"not run within the budget: {', '.join(skipped)} (`antman bench models --device cuda "
                 f"--profiles {','.join(skipped)} --pairs-with resnet50,lstm_lm` runs them)")
    if merged["profiles"]:
        ctx.note("antman bench models --device cuda --pairs-with resnet50,lstm_lm "
                 f"--window-s {WINDOW_S:g} --warmup {WARMUP} (in chunks):")
        ctx.note("```\n" + bench_models.table(merged) + "\n```")
