"""Telemetry sources: the emulation (here) and NVML (on a GPU machine, marked gpu)."""

from __future__ import annotations

import pytest

from slurm_antman.sidecar.telemetry import (
    EmulatedTelemetry, NvmlTelemetry, ReportedLoad, TelemetryError, UtilizationWindow, open_telemetry,
)

MiB = 1 << 20


def _nvml_works() -> bool:
    try:
        NvmlTelemetry().close()
        return True
    except TelemetryError:
        return False


NVML = _nvml_works()


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def test_emulated_numbers_come_from_reports(caplog):
    caplog.set_level("WARNING")
    t = open_telemetry("emulated", 2, 1024 * MiB)
    assert t.kind == "emulated" and t.gpu_count() == 2
    assert "EMULATED" in caplog.text
    gpus, procs = t.sample({1: ReportedLoad(300 * MiB, 0.6), 0: ReportedLoad(5000 * MiB, 3.0)})
    assert procs == []
    assert (gpus[0].memory_used_bytes, gpus[0].utilization) == (1024 * MiB, 1.0)  # clipped to the device
    assert (gpus[1].memory_used_bytes, gpus[1].utilization) == (300 * MiB, 0.6)
    assert all(g.memory_total_bytes == 1024 * MiB for g in gpus)


def test_emulated_rejects_empty_node():
    with pytest.raises(TelemetryError, match="at least one GPU"):
        EmulatedTelemetry(0, MiB)


def test_bad_mode_names_allowed_values():
    with pytest.raises(TelemetryError, match="allowed: auto, nvml, emulated"):
        open_telemetry("fake", 1, MiB)


@pytest.mark.skipif(NVML, reason="NVML works here; the no-GPU behaviour is tested on machines without one")
def test_without_nvml_auto_emulates_and_nvml_fails_clearly():
    assert open_telemetry("auto", 1, MiB).kind == "emulated"
    with pytest.raises(TelemetryError):
        open_telemetry("nvml", 1, MiB)


def test_utilization_window_averages_only_the_window():
    w = UtilizationWindow(10.0)
    for t, u in [(0, 1.0), (5, 1.0), (12, 0.2), (14, 0.4)]:
        w.add(t, 0, u)
    assert w.average(0) == pytest.approx((1.0 + 0.2 + 0.4) / 3)  # t=0 fell out at t=12
    assert w.average(3) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU with CUDA-enabled PyTorch")
def test_nvml_sees_gpus_and_this_process():
    import os
    import torch

    t = open_telemetry("auto", 1, MiB)
    try:
        assert t.kind == "nvml", "auto must pick NVML when it works"
        assert t.gpu_count() == torch.cuda.device_count()
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        gpus, procs = t.sample({})
        assert len(gpus) == t.gpu_count()
        g0 = gpus[0]
        assert g0.memory_total_bytes > 0 and g0.memory_used_bytes >= 512 * MiB
        assert 0.0 <= g0.utilization <= 1.0
        on0 = [pr for pr in procs if pr.gpu == 0]
        assert on0, "nvmlDeviceGetComputeRunningProcesses shows no process while we hold memory"
        mine = [pr for pr in on0 if pr.pid == os.getpid()]
        if mine and mine[0].memory_bytes is not None:  # pid namespaces may hide our own pid
            assert mine[0].memory_bytes >= 512 * MiB
        del x
    finally:
        t.close()
