"""A roofline cost model of one GPU step and of swap copies.

One step computes a batch of sequence chunks: ``n`` new tokens at positions ``s .. s + n - 1``
(a decode is ``n == 1``). Its time is two roofline terms and a fixed overhead::

    linear    = max(2 * dense_params * T + 2 * vocab * hidden * R  /  (FLOP/s * flops_eff),
                    weight_bytes                                     /  (B/s * bandwidth_eff))
    attention = max(4 * layers * q_dim * sum(n * s + n * (n + 1) / 2) / (FLOP/s * flops_eff),
                    kv_bytes_per_token * sum(s + 2 * n)               / (B/s * bandwidth_eff))
    step      = linear + attention * (1 + paged_overhead) + step_overhead_s

``T`` is the step's tokens, ``R`` the rows that sample (the LM head runs only for them). Weights
are read once per step whatever the batch; every chunk reads the K/V of its context (``s + n``
tokens) and writes its ``n`` new ones. ``paged_overhead`` is the extra cost of the paged attention
kernel over a contiguous one (the paper measures 20-26%); the contiguous-reservation baselines
run with 0. Tensor parallelism over ``num_gpus`` is taken as ideal (rates multiply, no
all-reduce cost). A swap copies ``blocks * block_bytes`` over the host link.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from asyncpaged.sim.presets import GpuSpec, ModelShape


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Step and swap durations for one model on ``num_gpus`` GPUs.

    Invariants: efficiencies in (0, 1]; overheads non-negative; a step's time is positive and
    never decreases when a chunk is added to it.
    """

    model: ModelShape
    gpu: GpuSpec
    num_gpus: int = 1
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    paged_overhead: float = 0.2
    step_overhead_s: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}.")
        if self.paged_overhead < 0 or self.step_overhead_s < 0 or self.num_gpus < 1:
            raise ValueError("paged_overhead and step_overhead_s must be >= 0, num_gpus >= 1.")

    @property
    def _flops(self) -> float:
        return self.gpu.flops_per_s * self.flops_efficiency * self.num_gpus

    @property
    def _bandwidth(self) -> float:
        return self.gpu.bandwidth_bytes_per_s * self.bandwidth_efficiency * self.num_gpus

    def step_time_s(
        self, chunks: Iterable[tuple[int, int]], num_sampling_rows: int, *, paged: bool = True
    ) -> float:
        """Seconds for one step over ``chunks`` of ``(start_pos, num_new_tokens)``."""
        m = self.model
        num_tokens = attn_macs = kv_tokens = 0
        for start, n in chunks:
            num_tokens += n
            attn_macs += n * start + n * (n + 1) // 2
            kv_tokens += start + 2 * n
        if num_tokens == 0:
            return self.step_overhead_s
        dense = m.num_params - (1 if m.tied_embeddings else 2) * m.vocab_size * m.hidden_size
        linear_flops = 2 * dense * num_tokens + 2 * m.vocab_size * m.hidden_size * num_sampling_rows
        linear = max(linear_flops / self._flops, m.weight_bytes / self._bandwidth)
        attn_flops = 4 * m.num_layers * m.num_heads * m.head_dim * attn_macs
        attention = max(
            attn_flops / self._flops, kv_tokens * m.kv_bytes_per_token / self._bandwidth
        )
        overhead = 1.0 + (self.paged_overhead if paged else 0.0)
        return linear + attention * overhead + self.step_overhead_s

    def swap_time_s(self, num_blocks: int, block_size: int) -> float:
        """Seconds to copy ``num_blocks`` KV blocks between host and device."""
        num_bytes = num_blocks * block_size * self.model.kv_bytes_per_token
        return num_bytes / (self.gpu.pcie_bytes_per_s * self.num_gpus)
