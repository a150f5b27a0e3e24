"""CUDA graphs of the decode forward (vLLM's CUDA graph runner), one per batch-size bucket.

A decode-only step (every sequence one new token) of up to ``max(sizes)`` sequences replays the
graph captured for the smallest size that holds it, padded: the host launches one graph instead of
each kernel of each layer. Everything a graph reads sits in static buffers that each step fills in
place (ids, positions, slots, context lengths, RoPE lengths, block tables). A padded row stores
nothing (slot -1) and attends one key through its row of the table (context length 1; the row
holds block ids of an earlier step, or 0: valid blocks), and its output is dropped.

What a graph may capture: an attention backend whose forward reads only device tensors and the
host facts a bucket fixes (``AttentionBackend.graph_safe``: the Triton kernels, whose split-K
count is then chosen for ``max_model_len`` and whose key loop stops at each row's own context
length), and a model whose rows stay apart and which reads nothing back on the host
(``CausalLM.cuda_graph_safe``: not MoE routing). The LM head and sampling run after the graph,
eagerly, on the rows that sample. ``capture`` is a parameter so tests can check the padding and
the buffers on a CPU with an eager stand-in for the graph (:func:`eager_capture`).

Under tensor parallelism every rank captures the same sizes in the same order, at once (each
warm-up and capture runs the layers' all-reduces, which pair across the ranks, and NCCL
collectives are captured into the graphs), and every rank replays for the same steps: whether a
step replays, and which bucket, follows from the step's plan alone, which every rank gets.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch

from asyncpaged._log import get_logger
from asyncpaged.model.attention import AttentionMetadata
from asyncpaged.model.base import CausalLM
from asyncpaged.model.kv_cache import PagedKVCache, SlotTargets

_log = get_logger(__name__)

#: ``capture(forward, pool)`` -> ``(replay, output, pool)``: ``replay()`` redoes ``forward`` on
#: the buffers' current contents into ``output``; graphs captured in turn share ``pool``.
Capture = Callable[
    [Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor, object]
]


def cuda_capture(
    forward: Callable[[], torch.Tensor], pool: object
) -> tuple[Callable[[], None], torch.Tensor, object]:
    """``forward`` run once (the warm-up compiles kernels and builds the backend's tile plans,
    which the capture must not copy from the host), then captured into a CUDA graph on ``pool``
    (the graphs share one memory pool: one replays at a time, and its output is read before
    the next replay)."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
        out = forward()
    return graph.replay, out, graph.pool()


def eager_capture(
    forward: Callable[[], torch.Tensor], pool: object
) -> tuple[Callable[[], None], torch.Tensor, object]:
    """A graph's semantics without CUDA: a replay reruns ``forward`` on the buffers as they
    are then and writes the one output tensor (the padding, the static buffers and the
    bucket-fixed host facts are exercised on any device; the tests' stand-in)."""
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return replay, out, pool


def capture_decode_graphs(
    model: CausalLM,
    kv_cache: PagedKVCache,
    *,
    sizes: Sequence[int],
    max_model_len: int,
    block_size: int,
    capture: Capture | None = None,
    name: str = "model",
) -> DecodeGraphs | None:
    """The decode graphs of ``model`` for these batch sizes, or None where they cannot run
    (no sizes, or a reason logged at INFO). ``capture`` None: CUDA graphs, on CUDA only.
    ``name``: which model the log events are about ("model", "draft")."""
    if not sizes:
        return None
    reason = None
    if capture is None and kv_cache.key.device.type != "cuda":
        reason = f"the device is {kv_cache.key.device.type}, not cuda"
    elif not model.attn_backend.graph_safe:
        reason = f"{type(model.attn_backend).__name__} cannot be captured"
    elif not model.cuda_graph_safe():
        reason = f"{type(model).__name__} reads device values on the host (MoE routing)"
    if reason is not None:
        _log.info("cuda_graphs_off", model=name, reason=reason)
        return None
    began = time.perf_counter()
    graphs = DecodeGraphs(
        model, kv_cache, sizes=sizes, max_model_len=max_model_len, block_size=block_size,
        capture=capture or cuda_capture,
    )  # fmt: skip
    _log.info("cuda_graphs_captured", model=name, sizes=graphs.sizes,
              seconds=round(time.perf_counter() - began, 2))  # fmt: skip
    return graphs


class DecodeGraphs:
    """The captured decode forwards of one model and KV cache.

    Invariants: graph ``b`` reads rows ``:b`` of the static buffers and writes the KV cache at
    those rows' slots and its own output only; in a replay for ``n < b`` sequences rows ``n:b``
    hold slot -1 and context length 1; the copies into the buffers and the replay run in order
    on the current stream; ``replays`` counts replays per size.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        *,
        sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        capture: Capture = cuda_capture,
    ) -> None:
        assert min(sizes, default=0) >= 1, f"capture sizes must be >= 1, got {sizes}"
        assert model.attn_backend.graph_safe, "the attention backend cannot be captured"
        self.sizes = tuple(sorted(set(sizes)))
        self.max_size = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_cache.key.device

        def buffer(fill: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        top = self.max_size
        self._ids, self._positions, self._slots = buffer(0, top), buffer(0, top), buffer(-1, top)
        self._context, self._rope = buffer(1, top), buffer(1, top)
        self._tables = buffer(0, top, self.max_blocks)
        starts = torch.arange(top + 1, dtype=torch.int64, device=device)
        # the smallest size holding n sequences, for every n up to the largest
        known = np.array(self.sizes)
        self._bucket: list[int] = known[np.searchsorted(known, np.arange(top + 1))].tolist()
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays: Counter[int] = Counter()
        pool: object = None
        for size in reversed(self.sizes):  # largest first: the pool grows once
            md = self._metadata(size, starts[: size + 1], max_model_len, block_size)
            model.attn_backend.pin_metadata(md)

            def forward(size: int = size, md: AttentionMetadata = md) -> torch.Tensor:
                out: torch.Tensor = model(self._ids[:size], self._positions[:size], md, kv_cache)
                return out

            replay, out, pool = capture(forward, pool)
            self._graphs[size] = (replay, out)

    def _metadata(
        self, size: int, starts: torch.Tensor, max_model_len: int, block_size: int
    ) -> AttentionMetadata:
        """A bucket's metadata over the static buffers. Its host facts are the bucket's: one
        token per sequence, and every context as long as ``max_model_len`` may be (the only
        use a graph-safe backend makes of them is the split-K count)."""
        slots = self._slots[:size]
        return AttentionMetadata(
            query_start_loc=starts,
            context_lens=self._context[:size],
            block_tables=self._tables[:size],
            block_tables_host=np.zeros((size, self.max_blocks), dtype=np.int64),
            slot_mapping=slots,
            token_rope_lens=self._rope[:size],
            query_start_loc_host=tuple(range(size + 1)),
            context_lens_host=(max_model_len,) * size,
            decode_indices=tuple(range(size)),
            prefill_indices=(),
            slot_targets=SlotTargets.of(slots, block_size),  # all -1 now: not read by a graph
            block_size=block_size,
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final hidden states [n, H] of a decode-only step through its bucket's graph
        (valid until the next replay), or None: not a decode-only step, too many sequences or
        a block table wider than ``max_model_len`` needs (run it eagerly)."""
        n = int(input_ids.shape[0])
        tables = md.block_tables
        if n > self.max_size or len(md.decode_indices) != n or len(md.context_lens_host) != n:
            return None
        width = int(tables.shape[1])
        if width > self.max_blocks:
            return None
        size = self._bucket[n]
        self._ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self._slots[:n].copy_(md.slot_mapping, non_blocking=True)
        self._context[:n].copy_(md.context_lens, non_blocking=True)
        self._rope[:n].copy_(md.token_rope_lens, non_blocking=True)
        self._tables[:n, :width].copy_(tables, non_blocking=True)
        if size > n:  # padded rows: store nothing, attend one key
            self._slots[n:size].fill_(-1)
            self._context[n:size].fill_(1)
        replay, out = self._graphs[size]
        replay()
        self.replays[size] += 1
        return out[:n]
