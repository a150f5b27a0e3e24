"""CUDA: a swap-out on the side stream reads a block only after the step that wrote it is done.

The step's write is queued on the compute stream behind a long GPU spin (``torch.cuda._sleep``)
and the host never synchronizes, as after a step that samples nothing; the swap is issued at
once from the host. It must copy the written values (it waits for the runner's step-end event),
not the stale ones. Runs where CUDA is available (the GPU machine's ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import pytest
import torch

from asyncpaged.model.kv_cache import PagedKVCache, swap_in, swap_out

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _caches() -> tuple[PagedKVCache, PagedKVCache]:
    shape = {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 64,
             "dtype": torch.float16}  # fmt: skip
    device = PagedKVCache(num_blocks=8, device="cuda", fill_value=0.0, **shape)
    host = PagedKVCache(num_blocks=8, device="cpu", fill_value=0.0, pin_memory=True, **shape)
    return device, host


def test_swap_out_waits_for_the_step_that_wrote_the_block() -> None:
    device, host = _caches()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
    device.key[:, 3].fill_(7.0)
    device.value[:, 3].fill_(-7.0)
    step_end = torch.cuda.Event()
    step_end.record(compute)  # what ModelRunner._record_step_end does
    swap_out(device, host, ((3, 5),), stream, step_end)
    assert torch.all(host.key[:, 5] == 7.0)
    assert torch.all(host.value[:, 5] == -7.0)


def test_swap_in_lands_before_a_later_step_reads_it() -> None:
    device, host = _caches()
    host.key[:, 2].fill_(3.0)
    host.value[:, 2].fill_(-3.0)
    stream = torch.cuda.Stream()
    swap_in(device, host, ((2, 6),), stream, None)  # returns once the copy has landed
    assert torch.all(device.key[:, 6] == 3.0)
    assert torch.all(device.value[:, 6] == -3.0)
