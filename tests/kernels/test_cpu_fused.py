"""The fused elementwise CPU kernels (``kernels/csrc/fused_ops.cpp``) against float64 references
and against the model's own torch code (``RMSNorm``, ``apply_rotary``, SiLU x up).

Each op runs on every build target the CPU runs (the others are skipped with the missing flags;
without g++ everything here skips) at 1 and 2 threads, on shapes that cover one token, a vector
tail (hidden 37, head dim 80 at 16 lanes), and calls large enough to take the OpenMP path. The
norm cases include rows small enough that ``eps`` matters, and an ``eps`` large enough to see
where it is added; SiLU covers the whole float range of exp (overflow, subnormals, NaN). In
bfloat16 (the norms and RoPE) the kernels must store the model's own bf16 code's bits: RoPE and
the residual sum everywhere, the norm's output everywhere but where an fp32 ulp of the sum of
squares crosses a bf16 rounding boundary (none in these cases, a few in 10^4 allowed).
"""

from __future__ import annotations

import pytest
import torch

from asyncpaged.kernels import cpu_build
from asyncpaged.kernels.cpu_fused import (
    add_rms_norm,
    reference_add_rms_norm,
    reference_rms_norm,
    reference_rotary,
    reference_silu_mul,
    rms_norm,
    rotary_,
    silu_mul,
)
from asyncpaged.model.llama import RMSNorm
from asyncpaged.model.rotary import RotaryEmbedding, apply_rotary

RTOL = ATOL = 1e-6  # a few fp32 ulps on values of order 1

NORM_SHAPES = ((1, 512), (7, 37), (300, 512))  # (T, H); 300 x 512 takes the threaded path
ROPE_TOKENS = (1, 5, 200)  # 200 tokens x 10 heads x 64+ dims takes the threaded path


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=RTOL, atol=atol, equal_nan=True)


def _norm_inputs(num_tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[::3] *= 1e-3  # mean(x^2) ~ 1e-6: eps matters for these rows
    residual = torch.randn(num_tokens, hidden, generator=gen) * 4
    weight = torch.randn(hidden, generator=gen)
    return x, residual, weight


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("eps", [1e-6, 0.05])
def test_rms_norm(target: str, threads: int, eps: float) -> None:
    for num_tokens, hidden in NORM_SHAPES:
        x, _, weight = _norm_inputs(num_tokens, hidden, seed=num_tokens)
        got = rms_norm(x, weight, eps, num_threads=threads, target=target)
        _close(got, reference_rms_norm(x.double(), weight.double(), eps))
        norm = RMSNorm(hidden, eps)
        norm.weight.data = weight
        with torch.inference_mode():
            _close(got, norm(x))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("eps", [1e-6, 0.05])
def test_add_rms_norm(target: str, threads: int, eps: float) -> None:
    for num_tokens, hidden in NORM_SHAPES:
        x, residual, weight = _norm_inputs(num_tokens, hidden, seed=num_tokens)
        x = x * 3  # the sum's scale differs from both inputs'
        want_residual, want = reference_add_rms_norm(residual, x, weight, eps)
        _, want64 = reference_add_rms_norm(residual.double(), x.double(), weight.double(), eps)
        got = add_rms_norm(residual, x, weight, eps, num_threads=threads, target=target)
        assert torch.equal(residual, want_residual), "residual must be residual + x, in place"
        _close(got, want64)
        _close(got, want)


def _cos_sin(num_tokens: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own cos/sin (yarn: attention scaling != 1) at scattered positions."""

    class Config:
        max_position_embeddings = 4096
        rope_parameters = {  # noqa: RUF012
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
        }

    rotary = RotaryEmbedding(Config(), head_dim, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    return rotary.cos_sin(positions, None, torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rotary(target: str, threads: int, head_dim: int) -> None:
    for num_tokens in ROPE_TOKENS:
        gen = torch.Generator().manual_seed(num_tokens + head_dim)
        q = torch.randn(num_tokens, 8, head_dim, generator=gen)
        k = torch.randn(num_tokens, 2, head_dim, generator=gen)
        cos, sin = _cos_sin(num_tokens, head_dim, seed=num_tokens)
        got_q, got_k = q.clone(), k.clone()
        rotary_(got_q, got_k, cos, sin, num_threads=threads, target=target)
        for got, x in ((got_q, q), (got_k, k)):
            _close(got, reference_rotary(x.double(), cos.double(), sin.double()))
            _close(got, apply_rotary(x, cos, sin))


def test_rotary_uses_both_halves_of_cos_sin_and_strided_tokens(target: str) -> None:
    """Arbitrary cos/sin (halves unequal), q as a view of wider rows, k absent."""
    gen = torch.Generator().manual_seed(3)
    cos, sin = torch.randn(2, 9, 80, generator=gen)
    wide = torch.randn(9, 12, 80, generator=gen)
    before = wide.clone()
    q = wide[:, 2:10]  # [9, 8, 80] with token stride 12 * 80
    want = reference_rotary(q.double(), cos.double(), sin.double())
    rotary_(q, None, cos, sin, target=target)
    _close(q, want)
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 10:], before[:, 10:])


def _silu_inputs(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(shape, generator=gen) * 6
    up = torch.randn(shape, generator=gen)
    return gate, up


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul(target: str, threads: int) -> None:
    for shape in ((1, 1376), (3, 37), (64, 1376)):  # 64 x 1376 takes the threaded path
        gate, up = _silu_inputs(shape, seed=shape[1])
        got = silu_mul(gate, up, num_threads=threads, target=target)
        _close(got, reference_silu_mul(gate.double(), up.double()))
        _close(got, reference_silu_mul(gate, up))
        in_place = gate.clone()
        silu_mul(in_place, up, out=in_place, num_threads=threads, target=target)
        assert torch.equal(in_place, got), "out=gate must give the same result"


def test_silu_mul_over_the_whole_range_of_exp(target: str) -> None:
    gate = torch.cat([torch.linspace(-110.0, 95.0, 20011), torch.tensor([0.0, -0.0, 1e-40])])
    up = torch.ones_like(gate)
    got = silu_mul(gate, up, target=target)
    # float64 where exp(-gate) fits fp32 (below, silu is x / inf = -0 in fp32, torch included);
    # relative to each value (subnormal results: absolutely, to the smallest normal)
    fits = gate > -88.5
    want = torch.nn.functional.silu(gate[fits].double())
    torch.testing.assert_close(got[fits].double(), want, rtol=RTOL, atol=1.2e-38)
    _close(got, torch.nn.functional.silu(gate), atol=1.2e-38)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 89.0, -89.0])
    got = silu_mul(special, torch.ones(5), target=target)
    want = torch.nn.functional.silu(special)  # nan, inf, nan (-inf / inf), 89, -0
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (got, want)


BF16_ROUNDING = 2.0**-8  # bf16's unit roundoff (8 significant bits)


def _bits_equal_share(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype == torch.bfloat16
    return float((got.view(torch.int16) == want.view(torch.int16)).double().mean())


@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_norms_store_the_models_bits(target: str, threads: int) -> None:
    """rms_norm / add_rms_norm in bf16 against the model's RMSNorm in bf16 (bits) and float64
    (two bf16 roundings: the normalised row, then its product with the weight)."""
    eps = 1e-6
    for num_tokens, hidden in NORM_SHAPES:
        x, residual, weight = (t.bfloat16() for t in _norm_inputs(num_tokens, hidden, num_tokens))
        norm = RMSNorm(hidden, eps)
        norm.weight.data = weight
        want_residual = residual + x  # the model's bf16 residual add
        got_residual = residual.clone()
        got = add_rms_norm(got_residual, x, weight, eps, num_threads=threads, target=target)
        assert torch.equal(got_residual, want_residual), "the bf16 sum, rounded as torch does"
        plain = rms_norm(want_residual, weight, eps, num_threads=threads, target=target)
        assert torch.equal(plain, got)
        with torch.inference_mode():
            want = norm(want_residual)
        assert got.dtype == torch.bfloat16
        assert _bits_equal_share(got, want) >= 0.9995
        want64 = reference_rms_norm(want_residual.double(), weight.double(), eps)
        torch.testing.assert_close(got.double(), want64, rtol=2 * BF16_ROUNDING, atol=1e-30)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_bfloat16_rotary_stores_the_models_bits(target: str, threads: int, head_dim: int) -> None:
    """RoPE in bf16 with the model's bf16 cos/sin: apply_rotary's bits exactly (each product
    and the sum rounded to bf16), and float64 within those three roundings."""
    for num_tokens in ROPE_TOKENS:
        gen = torch.Generator().manual_seed(num_tokens + head_dim)
        q = torch.randn(num_tokens, 8, head_dim, generator=gen).bfloat16()
        k = torch.randn(num_tokens, 2, head_dim, generator=gen).bfloat16()
        cos, sin = (t.bfloat16() for t in _cos_sin(num_tokens, head_dim, seed=num_tokens))
        got_q, got_k = q.clone(), k.clone()
        rotary_(got_q, got_k, cos, sin, num_threads=threads, target=target)
        for got, x in ((got_q, q), (got_k, k)):
            assert torch.equal(got, apply_rotary(x, cos, sin))
            want64 = reference_rotary(x.double(), cos.double(), sin.double())
            # |a c - b s| may cancel: bound each rounding by the products' size, not the result's
            a, half = x.double().abs(), head_dim // 2
            swapped = torch.cat((a[..., half:], a[..., :half]), dim=-1)
            scale = a * cos.double().abs()[:, None] + swapped * sin.double().abs()[:, None]
            assert bool(((got.double() - want64).abs() <= 3 * BF16_ROUNDING * scale).all())


def test_inputs_are_checked() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found")
    x, weight = torch.randn(4, 16), torch.randn(16)
    with pytest.raises(ValueError, match="float32"):
        rms_norm(x.double(), weight.double(), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(x.t(), weight[:4], 1e-6)
    with pytest.raises(ValueError, match="shaped like residual"):
        add_rms_norm(x, x[:2], weight, 1e-6)
    q, cos = torch.randn(4, 2, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rotary_(q, None, cos[:, :8], cos[:, :8])
    with pytest.raises(ValueError, match="shaped"):
        silu_mul(x, x[:2])
    with pytest.raises(ValueError, match="1-D bfloat16"):
        rms_norm(x.bfloat16(), weight, 1e-6)  # the weight in the rows' dtype
    with pytest.raises(ValueError, match="2-D bfloat16"):
        add_rms_norm(x.bfloat16(), x, weight.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="bfloat16"):
        rotary_(q.bfloat16(), None, cos, cos)
    with pytest.raises(ValueError, match="float32"):
        silu_mul(x.bfloat16(), x.bfloat16())  # float32 only
