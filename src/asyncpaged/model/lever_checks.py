"""Exactness checks of the CPU levers, run on the CPU at hand: ``cpu_plan`` turns off a lever
that fails its check, and says why.

A lever is exact when it gives the bits of the reference path, the torch code transformers runs,
at every row count the engine runs: packed linears (float32 and bfloat16) against ``F.linear`` on
exactly those rows, at every layer shape of the model (oneDNN picks its kernel by shape: on Zen 4
a [64 -> 64] bf16 layer packed differs where [64 -> 320] does not), each fused elementwise op
against the model's torch op, the screened heads against the float32 head's argmax. Checks draw
seeded random data at the model's shapes, run at the thread count the engine runs with, and are
cached with the plan's timings (``cpu_plan.json``).

What the checks find, and why (measured on Zen 4):

* bfloat16 ``F.linear`` runs through oneDNN, and packing keeps its weight layout, yet not always
  its kernel: bit-identical at most layer shapes, not at some small ones ([64 -> 64] here), so
  each of the model's shapes is checked. (A bias that requires grad is added outside the GEMM
  under autograd; the runner forwards under inference mode, and so does the check.)
* float32 ``F.linear`` runs through MKL (a 1-row GEMV, a GEMM from 2 rows, each row's bits the
  same in any GEMM from 2 rows); oneDNN's packed GEMM sums in another order (about 2x the
  float64 error here), so it is not exact. Forcing it on is the way to its speed.
* The fused ops round as torch does but fuse products into adds (FMA) and sum a norm's squares
  in another order: a few float32 ulps, and in bfloat16 one ulp in about 1e-5 of the norm's
  outputs (too rare for a random sample to be trusted to find, so bfloat16 is not checked: the
  construction decides).
* The screened heads rescore their candidates in float32: the float32 head's argmax.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

# Rows of the checked GEMMs: decode batches, bucket edges and prefill chunks, up to the engine's
# max_num_batched_tokens (which is always checked too).
CHECK_ROWS = (1, 2, 3, 5, 8, 16, 17, 33, 64, 100, 257, 513, 1025, 2049)
# Row counts up to SMALL_ROWS_MAX repeat with fresh rows, up to SMALL_ROWS rows a count and
# SMALL_ROWS_FLOPS multiply-adds x 2 a count (a large layer gets fewer).
SMALL_ROWS_MAX = 64
SMALL_ROWS = 4096
SMALL_ROWS_FLOPS = 4e9
# The LM head sees one row per sequence (decode batches); a large vocabulary makes each check
# GEMM costly, so a few row counts.
HEAD_ROWS = (1, 3, 17, 64)
NATIVE_BF16_DECODE_INEXACT = ("the paged kernel's fp32 math sums in another order than torch's "
                              "bf16 SDPA, which transformers calls")  # fmt: skip
FUSED_BF16_INEXACT = ("the fused RMSNorm sums the squares in another order than torch: one bf16 "
                      "ulp apart in about 1e-5 of its outputs, not bit-identical")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ExactnessCheck:
    """One lever's check on this CPU: whether it keeps the reference path's results, and what
    was compared."""

    exact: bool
    detail: str

    def to_json(self) -> list[object]:
        return [self.exact, self.detail]

    @classmethod
    def from_json(cls, value: object) -> ExactnessCheck:
        """The check ``to_json`` wrote; ValueError for anything else (a damaged cache)."""
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool)):
            raise ValueError(f"not an exactness check: {value!r}")
        return cls(value[0], str(value[1]))


Checker = Callable[[str, Mapping[str, int]], ExactnessCheck]


def check_rows(max_rows: int) -> tuple[int, ...]:
    """The row counts checked for an engine that runs up to ``max_rows`` rows a step."""
    return tuple(sorted({n for n in CHECK_ROWS if n <= max_rows} | {max_rows}))


def check_lever(probe: str, shapes: Mapping[str, int]) -> ExactnessCheck:
    """Check ``probe`` at ``shapes`` (``rows``: the engine's most rows a step): "packed_linear" /
    "packed_linear_bf16" for one layer shape (``in``, ``out``, ``bias``), "fused" (``hidden``,
    ``inter``, ``head_dim``), "bf16_head" / "int8_head" (``hidden``, ``vocab``)."""
    with torch.inference_mode():
        if probe == "packed_linear":
            return _packed(torch.float32, shapes)
        if probe == "packed_linear_bf16":
            return _packed(torch.bfloat16, shapes)
        if probe == "fused":
            return _fused_float32(shapes)
        if probe in ("bf16_head", "int8_head"):
            return _screen(probe, shapes)
    raise ValueError(f"unknown exactness probe {probe!r}")


# ---- packed linears -------------------------------------------------------------------------


def _repeats(rows: int, fan_in: int, fan_out: int) -> int:
    """GEMMs of ``rows`` rows to check: a kernel that rounds a few rows in 1,000 otherwise (a
    1-row bf16 [64 -> 64] GEMM on Zen 4: 3 rows in 2,000) needs thousands of rows to be seen, so
    small row counts repeat up to ``SMALL_ROWS`` rows, within ``SMALL_ROWS_FLOPS`` per count."""
    if rows > SMALL_ROWS_MAX:
        return 1
    affordable = int(SMALL_ROWS_FLOPS // (2 * fan_in * fan_out * rows))
    return max(1, min(SMALL_ROWS // rows, affordable))


def _packed(dtype: torch.dtype, shapes: Mapping[str, int]) -> ExactnessCheck:
    """One linear shape (``in``, ``out``, ``bias``: 0 or 1) at ``rows`` rows and fewer."""
    from asyncpaged.model.packed_linear import linear, pack_linears

    gen = torch.Generator().manual_seed(0)
    fan_in, fan_out, bias = shapes["in"], shapes["out"], bool(shapes["bias"])
    rows = check_rows(shapes["rows"])
    name = str(dtype).removeprefix("torch.")
    plain = torch.nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype)
    plain.weight.copy_(torch.randn(fan_out, fan_in, generator=gen) * fan_in**-0.5)
    if plain.bias is not None:
        plain.bias.copy_(torch.randn(fan_out, generator=gen))
    packed = copy.deepcopy(plain)
    if pack_linears(torch.nn.Sequential(packed), batch_hint=64) != 1:
        return ExactnessCheck(False, f"oneDNN did not pack a {name} layer here")
    differ = []
    for n in rows:
        for _ in range(_repeats(n, fan_in, fan_out)):
            x = (torch.randn(n, fan_in, generator=gen) * 2).to(dtype)
            want = torch.nn.functional.linear(x, plain.weight, plain.bias)  # transformers'
            if not torch.equal(linear(packed, x), want):  # the engine's: packed, bucketed
                differ.append(n)
                break
    layer = f"[{fan_in} -> {fan_out}{' + bias' if bias else ''}]"
    if differ:
        shown = ", ".join(map(str, differ[:4])) + (", ..." if len(differ) > 4 else "")
        return ExactnessCheck(False, f"packed {name} {layer} GEMMs not bit-identical to "
                                     f"F.linear at {len(differ)} of {len(rows)} row counts "
                                     f"({shown})")  # fmt: skip
    return ExactnessCheck(True, f"bit-identical to {name} F.linear at {len(rows)} row counts "
                                f"({rows[0]}-{rows[-1]})")  # fmt: skip


# ---- fused elementwise ops ------------------------------------------------------------------


def _fused_float32(shapes: Mapping[str, int]) -> ExactnessCheck:
    """Each fused op against the model's torch code, bit for bit."""
    from asyncpaged.kernels.cpu_fused import (
        fused_ops,
        reference_add_rms_norm,
        reference_rms_norm,
        reference_rotary,
        reference_silu_mul,
    )

    ops = fused_ops()
    if ops is None:
        return ExactnessCheck(False, "the native kernel library does not build here")
    gen = torch.Generator().manual_seed(1)
    hidden, inter, head_dim = shapes["hidden"], shapes["inter"], shapes["head_dim"]
    rows = min(shapes["rows"], 256)
    x, residual = (torch.randn(rows, hidden, generator=gen) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(hidden, generator=gen)
    q = torch.randn(rows, 4, head_dim, generator=gen)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 100
    cos, sin = (torch.cat((f, f), dim=-1) for f in (angles.cos(), angles.sin()))
    gate, up = (torch.randn(rows, inter, generator=gen) for _ in range(2))
    rotated = q.clone()
    ops.rotary_(rotated, None, cos, sin)
    summed = residual.clone()
    cases = {
        "rms_norm": (ops.rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6)),
        "add_rms_norm": (ops.add_rms_norm(summed, x, weight, 1e-6),
                         reference_add_rms_norm(residual, x, weight, 1e-6)[1]),
        "rotary": (rotated, reference_rotary(q, cos, sin)),
        "silu_mul": (ops.silu_mul(gate, up), reference_silu_mul(gate, up)),
    }  # fmt: skip
    differ = [f"{op} ({int((got != want).sum())} of {got.numel()})"
              for op, (got, want) in cases.items() if not torch.equal(got, want)]  # fmt: skip
    if differ:
        return ExactnessCheck(False, "fused float32 ops not bit-identical to torch's: "
                                     + ", ".join(differ))  # fmt: skip
    return ExactnessCheck(True, f"each fused float32 op bit-identical to torch's at {rows} rows")


# ---- screened heads -------------------------------------------------------------------------


def _screen(probe: str, shapes: Mapping[str, int]) -> ExactnessCheck:
    from asyncpaged.model.lm_head import ScreenedLMHead
    from asyncpaged.model.lm_head_int8 import (
        ACTIVATION_LIMITS,
        Int8ScreenedArgmax,
        int8_activation_limit,
    )

    gen = torch.Generator().manual_seed(2)
    hidden, vocab = shapes["hidden"], shapes["vocab"]
    weight = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5
    head = ScreenedLMHead(weight)
    argmax: Callable[[torch.Tensor], torch.Tensor | None] = head.argmax
    if probe == "int8_head":
        limit = int8_activation_limit() or ACTIVATION_LIMITS[0]
        argmax = Int8ScreenedArgmax(weight, rescorer=head, activation_limit=limit).argmax
    rows = tuple(n for n in HEAD_ROWS if n <= shapes["rows"]) or (shapes["rows"],)
    differ = []
    for n in rows:
        x = torch.randn(n, hidden, generator=gen)
        want = torch.argmax(torch.nn.functional.linear(x, weight), dim=-1)
        got = argmax(x)
        if got is None or not torch.equal(got, want):
            differ.append(n)
    if differ:
        return ExactnessCheck(False, f"the screened argmax differs from the float32 head's at "
                                     f"{', '.join(map(str, differ))} rows")  # fmt: skip
    return ExactnessCheck(True, f"the float32 head's argmax at {len(rows)} row counts "
                                f"({rows[0]}-{rows[-1]})")  # fmt: skip
