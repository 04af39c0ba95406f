"""The pure non-compliance rule (slurm_antman.policy.node.compliance): which opportunistic jobs the sidecar has requeued
for not keeping to their limits, and when."""

from __future__ import annotations

import dataclasses

from slurm_antman.policy.node.compliance import ComplianceParams, JobCompliance, MiB, step

P = ComplianceParams(grace_s=60.0)
GOOD = JobCompliance("7", shares_with_guaranteed=True, agents=1, gpu_processes=1,
                     unacked_since=None, mem_used_bytes=900 * MiB, mem_limit_bytes=1024 * MiB)


def run(job, times, since=None):
    since = dict(since or {})
    bad = {}
    for t in times:
        bad, since = step([job], since, P, t)
    return bad, since


def test_a_job_that_keeps_to_its_limits_is_compliant():
    assert run(GOOD, [100, 200, 300])[0] == {}


def test_no_agent_with_processes_on_a_shared_gpu_is_noncompliant_after_the_grace_time():
    j = dataclasses.replace(GOOD, agents=0)
    assert run(j, [1000, 1059])[0] == {}  # the grace time runs from when it was first seen
    bad, _ = run(j, [1000, 1060])
    assert "no agent registered" in bad["7"] and "60 s" in bad["7"]


def test_what_is_allowed():
    alone = dataclasses.replace(GOOD, agents=0, shares_with_guaranteed=False)  # ANTMAN_AGENT_DISABLE alone
    invisible = dataclasses.replace(GOOD, agents=0, gpu_processes=None)     # emulated telemetry: no say
    idle = dataclasses.replace(GOOD, agents=0, gpu_processes=0)             # not on the GPU (yet)
    paused = dataclasses.replace(GOOD, agents=0, paused=True, mem_used_bytes=10 << 30)
    for j in (alone, invisible, idle, paused):
        assert run(j, [0, 1000])[0] == {}, j


def test_unacknowledged_limits_count_from_when_they_were_sent():
    j = dataclasses.replace(GOOD, unacked_since=950.0)
    assert run(j, [1000])[0] == {}
    bad, _ = run(j, [1000, 1010])
    assert "does not acknowledge" in bad["7"]


def test_memory_over_the_limit_beyond_the_tolerance():
    within = dataclasses.replace(GOOD, mem_used_bytes=1024 * MiB + 102 * MiB + 256 * MiB)  # 10 % + slack
    assert run(within, [0, 1000])[0] == {}
    over = dataclasses.replace(GOOD, mem_used_bytes=2048 * MiB)
    bad, _ = run(over, [0, 60])
    assert "2048 MiB of GPU memory, over its limit of 1024 MiB" in bad["7"]


def test_a_condition_that_clears_restarts_its_clock():
    over = dataclasses.replace(GOOD, mem_used_bytes=2048 * MiB)
    _, since = run(over, [0, 30])
    _, since = step([GOOD], since, P, 40)   # back under the limit
    bad, _ = run(over, [50, 100], since)      # over again from 50: 50 s, not 100
    assert bad == {}
