"""Memory limits: tracked and acknowledged on CPU; enforced, shrunk and spilled on CUDA."""

from __future__ import annotations

import pytest
import torch

from torch_patch.memory import MemoryController, MemoryLimitError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is false)")


def test_cpu_limit_goes_down_and_up_and_is_reported():
    mc = MemoryController(use_cuda=False)
    assert mc.stats().limit_bytes is None
    mc.set_limit(4 << 30)
    mc.set_limit(1 << 30)
    st = mc.stats()
    assert st.limit_bytes == 1 << 30 and st.reserved_bytes > 0 and st.peak_bytes >= st.reserved_bytes
    mc.set_limit(None)
    assert mc.stats().limit_bytes is None
    assert set(st.as_dict()) == {"allocated_bytes", "reserved_bytes", "peak_bytes", "spilled_bytes",
                                 "limit_bytes", "total_bytes"}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1G", True])
def test_bad_limit_is_rejected(bad):
    with pytest.raises(MemoryLimitError, match="positive number of bytes or null"):
        MemoryController(use_cuda=False).set_limit(bad)


@pytest.mark.gpu
@needs_cuda
def test_cuda_shrink_frees_cached_memory_and_enforces_the_limit():
    mc = MemoryController(use_cuda=True)
    total = mc.total_bytes
    try:
        x = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        del x
        assert torch.cuda.memory_reserved() >= 512 << 20  # cached, not returned
        mc.set_limit(256 << 20)
        assert torch.cuda.memory_reserved() < 512 << 20, "shrinking must empty the cache"
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(400 << 20, dtype=torch.uint8, device="cuda")
        mc.set_limit(1 << 30)  # and up again
        y = torch.empty(400 << 20, dtype=torch.uint8, device="cuda")
        assert mc.stats().allocated_bytes >= 400 << 20
        del y
    finally:
        mc.set_limit(None)
        torch.cuda.empty_cache()
    assert total > 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_opportunistic_allocation_over_the_limit_spills_to_host():
    mc = MemoryController(use_cuda=True, spill=True)
    assert mc.spill is not None, "host spill could not be set up"
    try:
        # The job's footprint first (512 MiB), then a guaranteed job's claim brings the limit to 256
        # MiB: the pool is filled for what no longer fits, and the same allocations train on.
        keep = [torch.ones(128 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
        del keep
        mc.set_limit(256 << 20)
        assert mc.spill.held_bytes >= 256 << 20
        keep = [torch.ones(128 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]  # 512 MiB
        st = mc.stats()
        assert st.spilled_bytes >= 256 << 20 and st.reserved_bytes <= 256 << 20
        # min and max, not sum: a sum of uint8 makes a 1 GiB int64 copy, over any limit here.
        assert all(int(t.min()) == 1 == int(t.max()) for t in keep)
        del keep
    finally:
        mc.set_limit(None)
        torch.cuda.empty_cache()
