"""Decode steps through captured graphs (``worker/cuda_graphs.py``) give transformers' greedy tokens
and store K/V exactly where the eager forward does: padded rows write nothing.

On CUDA (``ASYNCPAGED_KERNELS_NATIVE=1``, ``scripts/gpu_check.sh``) the graphs are real CUDA
graphs. On the CPU the Triton kernels run under the interpreter and an eager stand-in replaces
the capture: it replays the same forward on the static buffers into the same output tensor, so
the buckets, the padding, the buffers and the bucket-fixed host facts are what is checked here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.config import cuda_graph_sizes
from asyncpaged.distributed import TensorParallelRunner
from asyncpaged.kernels.backend import TritonAttentionBackend, logical_cache_views
from asyncpaged.model.attention import AttentionMetadata
from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from asyncpaged.worker.cuda_graphs import Capture, eager_capture
from asyncpaged.worker.protocol import StepPlan, StepResult
from asyncpaged.worker.runner import ModelRunner
from tests.engine.conftest import perturbed_draft
from tests.kernels.conftest import NATIVE
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference

CAPTURE: Capture | None = None if NATIVE else eager_capture
__all__ = ["perturbed_draft"]  # (a fixture)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: build_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        for name in (
            "llama-gqa",
            "mistral",
            "phi3-longrope",
            "llama-rope-dynamic",
            "gemma2",
            "qwen3",
            "qwen3-moe",
        )
    }


def _sequences() -> list[SimSequence]:
    """Seven sequences, all started by step 2 (prefills mixed with decodes until then), ending
    at steps 3, 6, 9, 9, 12, 15 and 16: decode-only steps of 7, 6, 5, 3, 2 and 1 sequences,
    and a 17-token prompt whose decodes cross a block boundary."""
    lengths = (17, 5, 9, 3, 12, 1, 7)
    new_tokens = (4, 6, 8, 10, 12, 14, 17)
    return [
        SimSequence(
            seq_id=i,
            prompt=tuple(range(10 + 7 * i, 10 + 7 * i + n)),
            max_new_tokens=new_tokens[i],
            start_step=i % 3,
        )
        for i, n in enumerate(lengths)
    ]


def _run(checkpoint: Path, sizes: tuple[int, ...], device: torch.device) -> ModelRunner:
    runner = ModelRunner(
        checkpoint, "float32", num_blocks=48, device=device,
        attn_backend=TritonAttentionBackend(), kv_fill_value=float("nan"),
    )  # fmt: skip
    assert runner.capture_cuda_graphs(sizes, max_model_len=64, capture=CAPTURE) == sizes
    return runner


# mistral: sliding window 12; phi3-longrope: RoPE factors by sequence length (long past 20);
# llama-rope-dynamic: frequencies by sequence length, computed on the device (past 16);
# gemma2: softcapped scores, sliding and global layers; qwen3: q/k norms
@pytest.mark.parametrize(
    "name", ["llama-gqa", "mistral", "phi3-longrope", "llama-rope-dynamic", "gemma2", "qwen3"]
)
def test_decode_graphs_give_the_eager_tokens_and_cache(
    name: str, checkpoints: dict[str, Path], device: torch.device
) -> None:
    graphed = _run(checkpoints[name], (1, 2, 4), device)
    eager = ModelRunner(
        checkpoints[name], "float32", num_blocks=48, device=device,
        attn_backend=TritonAttentionBackend(), kv_fill_value=float("nan"),
    )  # fmt: skip
    runs = []
    for runner in (graphed, eager):
        seqs = _sequences()
        Driver(runner, seed=4, want_logprob=False).run(seqs)
        runs.append([s.output for s in seqs])
    assert runs[0] == runs[1]
    assert graphed.graphs is not None
    # 7, 6 and 5 sequences ran eagerly (more than 4), 3 padded into the graph of 4 (steps
    # 10-12), 2 and 1 in their own
    assert graphed.graphs.replays == {4: 3, 2: 3, 1: 1}
    for got, want in ((graphed.kv_cache.key, eager.kv_cache.key),
                      (graphed.kv_cache.value, eager.kv_cache.value)):  # fmt: skip
        assert torch.equal(got.isnan(), want.isnan()), "a padded row stored K/V"
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_decode_graphs_give_transformers_greedy_tokens(
    checkpoints: dict[str, Path], device: torch.device
) -> None:
    reference = HFReference(checkpoints["llama-gqa"])
    runner = _run(checkpoints["llama-gqa"], (1, 2, 4, 8), device)
    flags = []
    execute = runner.execute

    def flagged(plan: StepPlan) -> StepResult:
        result = execute(plan)
        flags.append(result.cuda_graph)
        return result

    runner.execute = flagged  # type: ignore[method-assign]
    seqs = _sequences()
    Driver(runner, seed=2, want_logprob=False).run(seqs)
    want = [reference.generate(s.prompt, s.max_new_tokens)[0] for s in _sequences()]
    assert [s.output for s in seqs] == want
    assert runner.graphs is not None
    assert runner.graphs.replays == {8: 7, 4: 3, 2: 3, 1: 1}
    assert flags.count(True) == 14  # each replayed step says so (the engine counts them)
    assert flags[:3] == [False, False, False]  # prefills mixed with decodes: eager


@torch.inference_mode()  # as the runner calls it (the buffers are inference tensors)
def test_padded_rows_store_nothing_where_the_last_replay_stored(
    checkpoints: dict[str, Path], device: torch.device
) -> None:
    """A replay for fewer sequences than the one before it in the same graph: the rows left
    over hold the last replay's slots, whose blocks the scheduler may have handed to another
    sequence since (here: overwritten with a sentinel). They stay untouched, and the real
    rows get the eager forward's hidden states."""
    runner = _run(checkpoints["llama-gqa"], (4,), device)
    assert runner.graphs is not None
    cache = runner.kv_cache
    generator = torch.Generator().manual_seed(0)
    for t in (cache.key, cache.value):
        t.copy_(torch.randn(t.shape, generator=generator).to(t.device))

    def step(context: list[int]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        n = len(context)  # sequence i: block i, its last token new
        md = AttentionMetadata.build(
            query_lens=[1] * n, context_lens=context, block_tables=[[i] for i in range(n)],
            slot_mapping=[16 * i + c - 1 for i, c in enumerate(context)], device=device,
        )  # fmt: skip
        ids = torch.tensor([7 + i for i in range(n)], device=device)
        return md, ids, torch.tensor([c - 1 for c in context], device=device)

    md, ids, positions = step([3, 5, 2, 4])
    assert runner.graphs.run(ids, positions, md) is not None
    stale = [(2, 1), (3, 3)]  # (block, offset) of the last replay's rows 2 and 3
    assert cache.layout == TritonAttentionBackend.kv_layout == "nhd"

    def slot(block: int, offset: int) -> list[torch.Tensor]:  # its K and V rows, every layer
        views = [logical_cache_views(cache, layer) for layer in range(cache.num_layers)]
        return [t[block, offset] for kv in views for t in kv]

    for block, offset in stale:
        for rows in slot(block, offset):
            rows.fill_(7.0)
    md, ids, positions = step([4, 6])
    hidden = runner.graphs.run(ids, positions, md)
    assert hidden is not None
    assert hidden.shape[0] == 2
    for block, offset in stale:
        assert all(bool((rows == 7.0).all()) for rows in slot(block, offset)), "a padded row stored"
    want = runner.model(ids, positions, md, cache)  # rewrites the same two slots
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


def test_graphs_stay_off_where_they_cannot_run(checkpoints: dict[str, Path]) -> None:
    from asyncpaged.model.attention import TorchAttentionBackend

    torch_backend = ModelRunner(
        checkpoints["llama-gqa"], "float32", num_blocks=8, attn_backend=TorchAttentionBackend()
    )
    assert torch_backend.capture_cuda_graphs((1, 2), 64, capture=eager_capture) == ()
    assert torch_backend.graphs is None
    cpu = ModelRunner(
        checkpoints["llama-gqa"], "float32", num_blocks=8, attn_backend=TritonAttentionBackend()
    )
    assert cpu.capture_cuda_graphs((1, 2), 64) == ()  # real CUDA graphs on a CPU: no
    assert cpu.capture_cuda_graphs((), 64, capture=eager_capture) == ()
    moe = ModelRunner(
        checkpoints["qwen3-moe"], "float32", num_blocks=8, attn_backend=TritonAttentionBackend()
    )
    assert moe.capture_cuda_graphs((1, 2), 64, capture=eager_capture) == ()  # host-synced
    assert moe.graphs is None


def test_capture_sizes_follow_the_config() -> None:
    cuda = EngineConfig(model="m", device="cuda", max_num_seqs=256)
    assert cuda_graph_sizes(cuda) == (1, 2, 4, *range(8, 257, 8))
    small = EngineConfig(model="m", device="cuda:0", max_cudagraph_capture_size=20)
    assert cuda_graph_sizes(small) == (1, 2, 4, 8, 16, 20)
    assert cuda_graph_sizes(EngineConfig(model="m", device="cuda", max_num_seqs=3)) == (1, 2, 3)
    for off in (
        EngineConfig(model="m", device="cuda", enforce_eager=True),
        EngineConfig(model="m", device="cpu"),
        EngineConfig(model="m", device="cuda", attention_backend="torch"),
    ):
        assert cuda_graph_sizes(off) == ()
    tp = EngineConfig(model="m", device="cuda", tensor_parallel_size=2, max_num_seqs=16)
    assert cuda_graph_sizes(tp) == (1, 2, 4, 8, 16)  # every rank captures them


async def _engine_tokens(model: Path, enforce_eager: bool) -> tuple[list[list[int]], int]:
    config = EngineConfig(model=str(model), dtype="float32", num_device_blocks=48,
                          device="cuda" if NATIVE else "cpu", attention_backend="triton",
                          enforce_eager=enforce_eager, executor_backend="thread")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(5 + 9 * i, 12 + 11 * i)) for i in range(5)]
    async with AsyncEngine(config) as engine:
        outs = [(await engine.generate(p, params)).outputs[0].token_ids for p in prompts[:1]]
        async with anyio.create_task_group() as tg:
            rest: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                rest[i] = (await engine.generate(prompts[i], params)).outputs[0].token_ids

            for i in range(1, len(prompts)):
                tg.start_soon(one, i)
        graphs = engine.runner.graphs if engine.runner is not None else None
        replays = 0 if graphs is None else sum(graphs.replays.values())
        assert engine.statistics().num_cuda_graph_steps == replays
    return outs + [rest[i] for i in range(1, len(prompts))], replays


def test_engine_replays_graphs_on_cuda_only(checkpoints: dict[str, Path]) -> None:
    """Through the public API: on CUDA the default captures and replays (tokens as eager);
    on a CPU the same config runs eagerly."""
    eager, none = anyio.run(_engine_tokens, checkpoints["llama-gqa"], True)
    default, replays = anyio.run(_engine_tokens, checkpoints["llama-gqa"], False)
    assert default == eager
    assert none == 0
    if NATIVE:
        assert replays > 0
    else:
        assert replays == 0


def graphs_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
    module: object,
    runner: type[ModelRunner] | type[TensorParallelRunner],
) -> None:
    """An engine on the CPU takes the graph path: ``module``'s ``cuda_graph_sizes`` gives
    (1, 2, 4) unless ``enforce_eager`` (the config gives sizes to CUDA only), and ``runner``
    captures with the eager stand-in."""
    monkeypatch.setattr(module, "cuda_graph_sizes",
                        lambda config: () if config.enforce_eager else (1, 2, 4))  # fmt: skip
    capture = runner.capture_cuda_graphs

    def stand_in(self: Any, sizes: tuple[int, ...], max_len: int,
                 _: Capture | None = None) -> tuple[int, ...]:  # fmt: skip
        return capture(self, sizes, max_len, eager_capture)

    monkeypatch.setattr(runner, "capture_cuda_graphs", stand_in)


@pytest.mark.skipif(NATIVE and torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs")
def test_tensor_parallel_ranks_capture_and_replay_together(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TP=2 through the public API: both ranks capture the same buckets at start and replay
    them in the same steps (a rank that ran a step eagerly while the other replayed a padded
    bucket would all-reduce tensors of other shapes), and the tokens are transformers'
    greedy ones. Three sequences decode together, padded into the graph of 4. On the CPU the
    sizes the config gives only to CUDA are forced, and every rank captures with the eager
    stand-in."""
    from asyncpaged.distributed import driver

    if not NATIVE:
        graphs_on_the_cpu(monkeypatch, driver, TensorParallelRunner)
    checkpoint = checkpoints["llama-gqa"]
    prompts = [list(range(5 + 9 * i, 12 + 11 * i)) for i in range(3)]
    max_tokens = (3, 6, 8)
    config = EngineConfig(model=str(checkpoint), dtype="float32", num_device_blocks=48,
                          device="cuda" if NATIVE else "cpu", attention_backend="triton",
                          tensor_parallel_size=2)  # fmt: skip

    async def main() -> tuple[list[list[int]], int, int]:
        async with AsyncEngine(config) as engine:
            assert isinstance(engine._workers, TensorParallelRunner)
            outs: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                        ignore_eos=True)  # fmt: skip
                outs[i] = (await engine.generate(prompts[i], params)).outputs[0].token_ids

            with anyio.fail_after(120):  # (mismatched all-reduces may hang instead)
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(one, i)
            graphs = engine.runner.graphs if engine.runner is not None else None
            assert graphs is not None, "rank 0 captured nothing"
            padded = graphs.replays[4]
            replays = engine.statistics().num_cuda_graph_steps
        return [outs[i] for i in range(len(prompts))], replays, padded

    with caplog.at_level(logging.INFO, logger="asyncpaged"):
        got, replays, padded = anyio.run(main)
    captured = [r for r in caplog.records if getattr(r, "event", None) == "cuda_graphs_captured"]
    # rank 1's capture event reached this process's logging through rank 0
    assert sorted(r.processName for r in captured) == ["MainProcess", "asyncpaged-tp-rank-1"]
    reference = HFReference(checkpoint)
    want = [reference.generate(tuple(p), n)[0] for p, n in zip(prompts, max_tokens, strict=True)]
    assert got == want
    assert replays > 0 and padded > 0  # three decoding sequences replayed the graph of 4


def test_draft_model_proposes_through_its_own_graphs(
    checkpoints: dict[str, Path],
    perturbed_draft: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A draft model's proposal decodes (and its pass over decode-only steps) replay the
    draft's own graphs: the same proposals as eagerly (as many drafted and kept), and the
    tokens are transformers' greedy ones. On the CPU the sizes the config gives only to CUDA
    are forced, with the eager stand-in."""
    from asyncpaged import SpeculativeConfig
    from asyncpaged.distributed import driver  # (worker_spec: the sizes every runner captures)

    checkpoint = checkpoints["llama-gqa"]
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                             model=str(perturbed_draft("llama-gqa")))  # fmt: skip
    prompts = [list(range(5 + 9 * i, 12 + 11 * i)) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(enforce_eager: bool) -> tuple[list[list[int]], tuple[int, int], int]:
        config = EngineConfig(model=str(checkpoint), dtype="float32", num_device_blocks=48,
                              device="cuda" if NATIVE else "cpu", attention_backend="triton",
                              speculative_config=spec, executor_backend="thread",
                              enforce_eager=enforce_eager)  # fmt: skip
        async with AsyncEngine(config) as engine:
            outs: dict[int, list[int]] = {}

            async def one(i: int) -> None:
                outs[i] = (await engine.generate(prompts[i], params)).outputs[0].token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = engine.statistics()
            assert engine.runner is not None and engine.runner.draft is not None
            graphs = engine.runner.draft.graphs
            replays = 0 if graphs is None else sum(graphs.replays.values())
        counts = (stats.num_draft_tokens, stats.num_accepted_tokens)
        return [outs[i] for i in range(len(prompts))], counts, replays

    eager, eager_counts, none = anyio.run(run, True)
    if not NATIVE:
        graphs_on_the_cpu(monkeypatch, driver, ModelRunner)
    graphed, counts, replays = anyio.run(run, False)
    reference = HFReference(checkpoint)
    assert graphed == eager == [reference.generate(tuple(p), 8)[0] for p in prompts]
    assert counts == eager_counts and 0 < counts[1] < counts[0]
    assert none == 0 and replays > 0
