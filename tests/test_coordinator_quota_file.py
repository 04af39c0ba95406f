"""antman_quota.lua, what the coordinator tells job_submit.lua about tenant quota use: the use, and since
2026-11-25 the time of the snapshot (as_of), so job_submit.lua can count its own guaranteed admissions that
the snapshot cannot have seen yet."""

from __future__ import annotations

import shutil
import subprocess
from types import SimpleNamespace

import pytest

from slurm_antman import config as cfgmod
from slurm_antman.coordinator.daemon import Coordinator, quota_lua
from slurm_antman.policy.cluster.model import JobView

LUA = shutil.which("lua5.1")


def _job(job_id: str, account: str, state: str, job_class: str, gpus: int, held: bool = False) -> JobView:
    return JobView(job_id, account, "ann", state, job_class, job_class, gpus, None, 0.0, None, 0, None, held)


def _snap(jobs: list[JobView], quotas: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(jobs=tuple(jobs), quotas=quotas)


def test_quota_lua_carries_as_of_and_the_use() -> None:
    snap = _snap([_job("1", "research", "RUNNING", "guaranteed", 2),
                  _job("2", "research", "PENDING", "guaranteed", 1),
                  _job("3", "research", "PENDING", "guaranteed", 4, held=True),  # held for quota: not counted
                  _job("4", "research", "RUNNING", "opportunistic", 1),
                  _job("5", "product", "RUNNING", "guaranteed", 1)],
                 {"research": 4, "product": 2})
    text = quota_lua(snap, 1767225600.123456)
    assert "as_of = 1767225600.123," in text
    # the rows keep the form the cluster tests and admins grep for
    assert '["research"] = { quota = 4, used = 3 },' in text
    assert '["product"] = { quota = 2, used = 1 },' in text
    # pure: the same snapshot and time give the same text, another time another as_of
    assert quota_lua(snap, 1767225600.123456) == text
    assert "as_of = 1767225601.000," in quota_lua(snap, 1767225601)


@pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed")
def test_quota_lua_is_the_table_job_submit_reads(tmp_path) -> None:
    f = tmp_path / "antman_quota.lua"
    f.write_text(quota_lua(_snap([_job("1", "research", "RUNNING", "guaranteed", 3)], {"research": 4}), 1000.5))
    probe = (f'local chunk = loadfile({str(f)!r}); setfenv(chunk, {{}}); local q = chunk(); '
             'print(q.as_of, q.accounts.research.quota, q.accounts.research.used)')
    r = subprocess.run([LUA, "-e", probe], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1000.5", "4", "3"]


class _Backend:
    """Slurm with no jobs and no nodes; notes the clock when squeue is read."""

    def __init__(self, clock: "_Clock") -> None:
        self.clock = clock
        self.read_at: list[float] = []

    def jobs(self) -> list:
        self.read_at.append(self.clock.last)
        return []

    def nodes(self) -> list:
        return []


class _Clock:
    def __init__(self) -> None:
        self.last = 100.0

    def __call__(self) -> float:
        self.last += 1.0
        return self.last


def _as_of(path) -> float:
    line = next(ln for ln in path.read_text().splitlines() if "as_of" in ln)
    return float(line.split("as_of = ")[1].split(",")[0])


def test_every_cycle_writes_the_file_with_the_time_taken_before_squeue(tmp_path) -> None:
    quota = tmp_path / "antman_quota.lua"
    cfg = cfgmod.parse({"nodes": [{"name": "n1", "gpus": 2}],
                        "tenants": [{"account": "research", "guaranteed_gpus": 2}],
                        "coordinator": {"audit_log": str(tmp_path / "audit.jsonl"), "quota_file": str(quota),
                                        "quota_source": "antman_yaml"}})
    clock = _Clock()
    backend = _Backend(clock)
    coord = Coordinator(cfg, backend=backend, clock=clock)  # type: ignore[arg-type]
    coord.run_cycle()
    first = _as_of(quota)
    assert first <= backend.read_at[0]
    assert '["research"] = { quota = 2, used = 0 },' in quota.read_text()
    # Nothing changed in Slurm, and the file is written again: its newer as_of is the news.
    coord.run_cycle()
    second = _as_of(quota)
    assert first < second <= backend.read_at[1]
    assert not (tmp_path / "antman_quota.lua.tmp").exists()
