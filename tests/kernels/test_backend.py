"""The Triton backend inside the model runner: greedy tokens equal the torch backend's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncpaged.kernels.backend import (
    KV_LAYOUT_ENV,
    TritonAttentionBackend,
    logical_cache_views,
    make_attention_backend,
)
from asyncpaged.model.attention import AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from asyncpaged.worker.runner import ModelRunner
from tests.kernels.conftest import NATIVE
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: build_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        for name in ("llama-gqa", "mistral")
    }


def _sequences() -> list[SimSequence]:
    return [
        SimSequence(seq_id=0, prompt=tuple(range(5, 22)), max_new_tokens=6),  # 17: a page + 1
        SimSequence(seq_id=1, prompt=tuple(range(30, 45)), max_new_tokens=5, start_step=1),
        SimSequence(  # chunked prefill across three steps while others decode
            seq_id=2, prompt=tuple(range(50, 90)), max_new_tokens=4, chunk_sizes=(16, 9, 15)
        ),
    ]


def _generate(checkpoint: Path, backend_name: str, device: torch.device) -> list[list[int]]:
    backend = TritonAttentionBackend() if backend_name == "triton" else TorchAttentionBackend()
    runner = ModelRunner(
        checkpoint,
        "float32",
        num_blocks=64,
        device=device,
        attn_backend=backend,
        kv_fill_value=float("nan"),
    )
    seqs = _sequences()
    Driver(runner, seed=1).run(seqs)
    return [s.output for s in seqs]


@pytest.mark.parametrize("name", ["llama-gqa", "mistral"])  # mistral: sliding window 12
def test_runner_greedy_tokens_match_torch_backend(
    name: str, checkpoints: dict[str, Path], device: torch.device
) -> None:
    want = _generate(checkpoints[name], "torch", torch.device("cpu"))
    got = _generate(checkpoints[name], "triton", device)
    assert got == want


def test_runner_greedy_tokens_match_transformers(
    checkpoints: dict[str, Path], device: torch.device
) -> None:
    reference = HFReference(checkpoints["llama-gqa"])
    want = [reference.generate(s.prompt, s.max_new_tokens)[0] for s in _sequences()]
    assert _generate(checkpoints["llama-gqa"], "triton", device) == want


def test_factory_picks_by_device_and_name() -> None:
    assert isinstance(make_attention_backend("cpu"), TorchAttentionBackend)
    assert isinstance(make_attention_backend("cpu", "torch"), TorchAttentionBackend)
    if not NATIVE:  # the interpreter stands in for CUDA
        assert isinstance(make_attention_backend("cpu", "triton"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        make_attention_backend("cpu", "flash")  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_factory_picks_triton_on_cuda() -> None:
    assert isinstance(make_attention_backend("cuda"), TritonAttentionBackend)


def test_backend_copy_on_write_uses_the_kernel_and_matches_torch() -> None:
    from asyncpaged.model.kv_cache import PagedKVCache

    device = torch.device("cuda" if NATIVE else "cpu")

    def cache() -> PagedKVCache:
        c = PagedKVCache(num_layers=3, num_blocks=12, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.float32, device=device, fill_value=float("nan"))  # fmt: skip
        g = torch.Generator(device="cpu").manual_seed(0)
        c.key[:, :6] = torch.randn(c.key[:, :6].shape, generator=g).to(device)
        c.value[:, :6] = torch.randn(c.value[:, :6].shape, generator=g).to(device)
        return c

    pairs = ((1, 7), (4, 9), (0, 11))
    want, got = cache(), cache()
    TorchAttentionBackend().copy_blocks(want, pairs)
    TritonAttentionBackend().copy_blocks(got, pairs)
    assert torch.equal(got.key.isnan(), want.key.isnan())  # untouched blocks stay NaN
    assert torch.equal(got.key.nan_to_num(), want.key.nan_to_num())
    assert torch.equal(got.value.nan_to_num(), want.value.nan_to_num())
    assert not got.key[:, 7].isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_cuda_swap_round_trip_on_a_side_stream() -> None:
    from asyncpaged.model.kv_cache import PagedKVCache, swap_in, swap_out

    def cache(device: str, n: int, pin: bool = False) -> PagedKVCache:
        return PagedKVCache(num_layers=2, num_blocks=n, block_size=16, num_kv_heads=2, head_dim=64,
                            dtype=torch.float16, device=device, fill_value=float("nan"),
                            pin_memory=pin)  # fmt: skip

    gpu, host = cache("cuda", 8), cache("cpu", 8, pin=True)
    gpu.key.normal_()
    gpu.value.normal_()
    stream = torch.cuda.Stream()
    swap_out(gpu, host, ((1, 5), (3, 0)), stream)
    assert torch.equal(host.key[:, 5], gpu.key[:, 1].cpu())
    assert host.key[:, 1].isnan().all()
    back = cache("cuda", 8)
    swap_in(back, host, ((5, 2), (0, 6)), stream)
    assert torch.equal(back.value[:, 2], gpu.value[:, 1])
    assert torch.equal(back.key[:, 6], gpu.key[:, 3])
    assert back.key[:, 0].isnan().all()


def test_runner_allocates_the_layout_its_backend_reads(tmp_path: Path) -> None:
    """The Triton backend's caches are "nhd" (device and host: swaps copy whole blocks), the
    torch path's the runner layout; tokens equal transformers' either way (tests above)."""
    path = build_tiny_checkpoint("llama-gqa", tmp_path)
    for backend, layout in ((TritonAttentionBackend(), "nhd"), (TorchAttentionBackend(), "runner")):
        runner = ModelRunner(path, "float32", num_blocks=8, num_host_blocks=2, attn_backend=backend)
        assert runner.kv_cache.layout == runner.host_kv_cache.layout == layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_layouts_write_and_attend_alike(dtype: torch.dtype) -> None:
    """One layer's step (two decodes, a chunk over a cached prefix, a whole prompt) over the
    same random cache in each layout: the new rows land in the same logical slots and the
    outputs are bit-identical (the kernel reads the same values in the same order; only the
    strides differ). Unused blocks are NaN, so a read outside the tables shows."""
    device = torch.device("cuda" if NATIVE else "cpu")
    heads, kv_heads, dim, blocks = 4, 2, 64, 12
    g = torch.Generator(device="cpu").manual_seed(3)
    content = (
        torch.randn(blocks, 16, kv_heads, dim, generator=g).to(dtype),
        torch.randn(blocks, 16, kv_heads, dim, generator=g).to(dtype),
    )
    used = [1, 2, 4, 5, 7, 8, 9, 10]
    tables = [[1, 2], [4], [5, 7], [8, 9, 10]]
    context, query = [20, 9, 30, 40], [1, 1, 14, 40]
    slots = [
        table[pos // 16] * 16 + pos % 16
        for table, ctx, q in zip(tables, context, query, strict=True)
        for pos in range(ctx - q, ctx)
    ]
    rows = sum(query)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype).to(device)
    k = torch.randn(rows, kv_heads, dim, generator=g).to(dtype).to(device)
    v = torch.randn(rows, kv_heads, dim, generator=g).to(dtype).to(device)
    md = AttentionMetadata.build(
        query_lens=query, context_lens=context, block_tables=tables, slot_mapping=slots,
        device=device,
    )  # fmt: skip
    outs, caches = [], []
    for layout in ("runner", "nhd"):
        cache = PagedKVCache(num_layers=1, num_blocks=blocks, block_size=16, num_kv_heads=kv_heads,
                             head_dim=dim, dtype=dtype, device=device, fill_value=float("nan"),
                             layout=layout)  # type: ignore[arg-type]  # fmt: skip
        key_view, value_view = logical_cache_views(cache, 0)
        for b in used:
            key_view[b], value_view[b] = content[0][b].to(device), content[1][b].to(device)
        out = TritonAttentionBackend().forward(0, q, k, v, cache, md, scale=dim**-0.5)
        outs.append(out.float().cpu())
        caches.append([t.float().cpu() for t in logical_cache_views(cache, 0)])
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(caches[0], caches[1], strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_the_layout_switch_gives_triton_the_runner_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ASYNCPAGED_TRITON_KV_LAYOUT=runner (the A/B switch of a GPU benchmark) makes the runner
    allocate K transposed per block for the Triton backend; a misspelling is refused."""
    path = build_tiny_checkpoint("llama-gqa", tmp_path)
    monkeypatch.setenv(KV_LAYOUT_ENV, "runner")
    runner = ModelRunner(path, "float32", num_blocks=8, attn_backend=TritonAttentionBackend())
    assert runner.kv_cache.layout == "runner"
    assert TritonAttentionBackend.kv_layout == "nhd"  # the class default is untouched
    monkeypatch.setenv(KV_LAYOUT_ENV, "hnd")
    with pytest.raises(ValueError, match=KV_LAYOUT_ENV):
        TritonAttentionBackend()
