"""Pinned host memory kept for pauses: the node's budget and who gets it (policy/node/pinning.py), the arena
kept or pinned ahead and reused by the next offload (torch_patch.pinned), the protocol field, the config's
default and `antman doctor`'s check against the RAM."""

from __future__ import annotations

import pytest
import torch

from slurm_antman import config
from slurm_antman.policy.node import core
from slurm_antman.policy.node.model import GpuInfo, JobInfo, NodePolicyParams, NodeSnapshot, PolicyState
from slurm_antman.policy.node.pinning import CHUNK_BYTES, need_bytes, pin_grants
from slurm_antman.protocol import messages as m

GiB = 1 << 30


def _opp(jid: str, t: float, gib: float, gpus=(0,), can_pause=True, elastic_group=None) -> JobInfo:
    return JobInfo(jid, "opportunistic", tuple(gpus), t, int(gib * GiB), can_pause=can_pause,
                   elastic_group=elastic_group)


def test_the_newest_job_beside_a_guaranteed_one_is_granted_first_and_whole():
    jobs = [_opp("old", 1.0, 3), _opp("new", 2.0, 3), _opp("newest", 3.0, 3)]
    # 3 GiB held -> 3.375 GiB -> 14 chunks of 256 MiB (3.5 GiB)
    assert need_bytes(jobs[0]) == 14 * CHUNK_BYTES
    grants = pin_grants(jobs, guarded_gpus={0}, paused=(), budget_bytes=8 * GiB)
    assert grants == {"newest": 14 * CHUNK_BYTES, "new": 14 * CHUNK_BYTES}  # 7 GiB; "old" would not fit whole
    # A paused job's state lies pinned already: counted first, whatever its age.
    assert list(pin_grants(jobs, {0}, paused={"old"}, budget_bytes=4 * GiB)) == ["old"]
    assert pin_grants(jobs, {0}, (), 0) == {}


def test_no_grant_where_no_pause_can_come():
    jobs = [_opp("alone", 1.0, 1, gpus=(1,)), _opp("old-agent", 2.0, 1, can_pause=False),
            _opp("array-task", 3.0, 1, elastic_group="77"),
            JobInfo("g", "guaranteed", (0,), 0.0, 4 * GiB)]
    assert pin_grants(jobs, guarded_gpus={0}, paused=(), budget_bytes=64 * GiB) == {}


def test_the_node_policy_gives_the_grant_with_the_limits():
    gpus = (GpuInfo(0, 80 * GiB, 0),)
    snap = NodeSnapshot(gpus, (JobInfo("g", "guaranteed", (0,), 0.0, 10 * GiB, iteration=5, iteration_ms=100.0),
                               _opp("o", 1.0, 2)))
    with_budget = core.decide(snap, PolicyState(), NodePolicyParams(pin_budget_bytes=16 * GiB), 10.0)
    assert with_budget.limits["o"].pin_bytes == need_bytes(snap.jobs[1]) > 0
    assert with_budget.limits["g"].pin_bytes == 0
    without = core.decide(snap, PolicyState(), NodePolicyParams(), 10.0)
    assert without.limits["o"].pin_bytes == 0
    assert without.limits["o"].mem_limit_bytes == with_budget.limits["o"].mem_limit_bytes


def test_limits_carry_pin_bytes_only_when_granted():
    from slurm_antman.protocol import codec

    plain = m.Limits(seq=3, mem_limit_bytes=GiB, compute_share=0.5)
    assert "pin_bytes" not in codec.body_dict(plain)  # an agent older than the field never meets it
    granted = m.Limits(seq=3, mem_limit_bytes=GiB, compute_share=0.5, pin_bytes=4 * GiB)
    back = codec.decode(codec.encode(codec.Message(body=granted)))
    assert back.body.pin_bytes == 4 * GiB
    with pytest.raises(codec.ProtocolError):
        codec.decode(codec.encode(codec.Message(body=m.Limits(seq=3, mem_limit_bytes=GiB, compute_share=0.5,
                                                              pin_bytes=-1))))


def test_the_budget_defaults_to_an_eighth_of_the_nodes_memory_and_doctor_weighs_it():
    from slurm_antman.admin.doctor.node import check_pin_budget

    cfg = config.parse({"nodes": [{"name": "g[1-2]", "gpus": 8, "memory_mb": 1024000}]})
    assert cfg.pin_budget_bytes("g1") == 128000 << 20
    assert config.parse({"nodes": [{"name": "g1", "gpus": 8}], "sidecar": {"pin_budget_mb": 0}}).pin_budget_bytes("g1") == 0
    assert check_pin_budget(cfg, "g1", lambda: 1024000 << 20).status == "ok"
    big = config.parse({"nodes": [{"name": "g1", "gpus": 8, "memory_mb": 1000}], "sidecar": {"pin_budget_mb": 600}})
    got = check_pin_budget(big, "g1", lambda: 1000 << 20)
    assert got.status == "fail" and "over half" in got.reason
    assert check_pin_budget(big, "g1", lambda: 2000 << 20).status == "warn"


class _Runtime:
    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaSetDevice(self, dev):
        return 0

    def cudaHostRegister(self, addr, n, flags):
        self.registered.append((addr, n))
        return 0

    def cudaHostUnregister(self, addr):
        self.unregistered.append(addr)
        return 0


def test_an_offload_reuses_a_kept_arena_that_fits_and_pins_afresh_past_it():
    from torch_patch import pinned

    chunk = 64 << 10
    rt = _Runtime()
    kept = pinned.prepin(torch, 300 << 10, rt=rt, device=0, threads=2, chunk=chunk)
    kept.finish()
    pinned_before = list(rt.registered)
    src = [torch.randn(20_000), torch.arange(5000)]
    timings: dict = {}
    hosts, arena = pinned.copy_out(torch, src, rt=rt, device=0, fallback=lambda t: pytest.fail("fell back"),
                                   sync=lambda: None, timings=timings, threads=2, chunk=chunk, kept=kept)
    assert arena is kept and timings["kept_arena"] and rt.registered == pinned_before  # nothing pinned anew
    assert all(torch.equal(h, s) for h, s in zip(hosts, src))
    assert hosts[0].data_ptr() == kept.base  # the slices are the kept arena's
    # Grown past it: the kept arena goes, a fresh one is pinned.
    big = [torch.randn(200_000)]
    timings = {}
    hosts, fresh = pinned.copy_out(torch, big, rt=rt, device=0, fallback=lambda t: pytest.fail("fell back"),
                                   sync=lambda: None, timings=timings, threads=2, chunk=chunk, kept=arena)
    assert fresh is not kept and not timings["kept_arena"] and torch.equal(hosts[0], big[0])
    fresh.release()
    kept.finish()
    assert sorted(rt.unregistered) == sorted(a for a, _ in rt.registered)  # both arenas unpinned, once each


def test_a_lowered_allowance_lets_a_larger_kept_arena_go():
    from torch_patch import pinned
    from torch_patch.pause import Pauser

    class Mem:
        cuda, emulated_bytes, device = False, None, 0

    p = Pauser(torch, Mem())
    rt = _Runtime()
    p._kept = pinned.prepin(torch, 1 << 20, rt=rt, device=0, threads=1, chunk=256 << 10)
    p.set_pin_allowance(8 << 20)
    assert p._kept is not None
    p.set_pin_allowance(512 << 10)
    assert p._kept is None and p.pin_allowance == 512 << 10


def test_bench_pin_copies_the_same_state_into_a_fresh_and_a_kept_arena():
    from slurm_antman.lab.bench import pin

    r = pin.measure(gib=0.02, rounds=2, threads=2)
    assert r["rounds"] == 2 and len(r["fresh_s"]) == len(r["kept_s"]) == 2 and len(r["prepin_s"]) == 1
    assert r["bytes"] == 64 * (int(0.02 * (1 << 30) / 4 / 4 / 16) * 4)
