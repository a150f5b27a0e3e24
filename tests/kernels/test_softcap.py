"""Attention logit softcapping (Gemma 2: scores ``softcap * tanh(scale * q.k / softcap)`` before
the mask and the softmax) in the native CPU kernels, the Triton kernel (interpreter) and their
backends.

Same cases as the kernels' own tests (float64 references, NaN-poisoned caches, scattered block
tables, GQA, page-boundary lengths), with queries scaled up so that the raw scores reach several
times the cap: tanh saturates and the capped attention differs clearly from the uncapped one
(each case checks that it does, so a kernel that ignored the cap would fail).
"""

from __future__ import annotations

import pytest
import torch

from asyncpaged.kernels import cpu_build
from asyncpaged.kernels.backend import TritonAttentionBackend
from asyncpaged.kernels.cpu_attention import DecodePlan
from asyncpaged.model.attention import TorchAttentionBackend
from tests.kernels.cases import make_case
from tests.kernels.test_cpu_attention import (
    Case,
    PrefillCase,
    _mixed_step,
    assert_matches,
    make_prefill_case,
)
from tests.kernels.test_cpu_attention import make_case as make_decode_case
from tests.kernels.test_paged_attention import _check, _run

needs_compiler = pytest.mark.skipif(cpu_build.find_compiler() is None, reason="g++ not found")
QUERY_SCALE = 3.0  # raw scores ~ N(0, 9): |s| > cap for most keys at caps 2-5


def assert_cap_matters(capped: torch.Tensor, uncapped: torch.Tensor) -> None:
    """The cap must change the attention well beyond any tolerance here."""
    assert float((capped - uncapped).abs().max()) > 0.1


# --- the native CPU kernels ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_cases() -> list[tuple[Case, int | None, float, torch.Tensor]]:
    """(case, window, softcap, float64 reference): fp32 and bf16, with and without a window."""
    cases = []
    for dtype, head_dim, heads, window, cap in (
        (torch.float32, 64, 8, None, 2.0),
        (torch.bfloat16, 128, 12, None, 5.0),
        (torch.float32, 256, 8, 17, 3.0),
        (torch.bfloat16, 256, 2, 40, 2.0),
    ):
        case = make_decode_case(head_dim=head_dim, heads=heads, dtype=dtype, seed=head_dim,
                                query_scale=QUERY_SCALE)  # fmt: skip
        want = case.reference(window, cap)
        assert_cap_matters(want, case.reference(window))
        cases.append((case, window, cap, want))
    return cases


@pytest.fixture(scope="module")
def prefill_cases() -> list[tuple[PrefillCase, int | None, float, torch.Tensor]]:
    cases = []
    for dtype, head_dim, heads, window, cap in (
        (torch.float32, 64, 8, None, 2.0),
        (torch.bfloat16, 80, 12, 17, 5.0),
        (torch.float32, 256, 8, 40, 3.0),
        (torch.bfloat16, 256, 2, None, 2.0),
    ):
        case = make_prefill_case(head_dim=head_dim, heads=heads, dtype=dtype, seed=head_dim,
                                 query_scale=QUERY_SCALE)  # fmt: skip
        want = case.reference(window, cap)
        assert_cap_matters(want, case.reference(window))
        cases.append((case, window, cap, want))
    return cases


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_softcap_each_build_target(
    target: str, threads: int, decode_cases: list[tuple[Case, int | None, float, torch.Tensor]]
) -> None:
    for case, window, cap, want in decode_cases:
        got = case.run(window, softcap=cap, num_threads=threads, target=target)
        assert_matches(got, want, case.key_cache.dtype)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_softcap_each_build_target(
    target: str,
    threads: int,
    prefill_cases: list[tuple[PrefillCase, int | None, float, torch.Tensor]],
) -> None:
    for case, window, cap, want in prefill_cases:
        got = case.run(window, softcap=cap, num_threads=threads, target=target)
        assert_matches(got, want, case.key_cache.dtype)


@needs_compiler
@pytest.mark.parametrize(
    ("query_tile", "key_tile_blocks"), [(1, 1), (7, 0), (5, 3)],
    ids=["q1-online1", "q7-twopass", "q5-online3"],
)  # fmt: skip
def test_prefill_softcap_across_key_tiles(query_tile: int, key_tile_blocks: int) -> None:
    """The capped scores go through the online softmax over several key tiles alike."""
    case = make_prefill_case(heads=8, seed=query_tile, query_scale=QUERY_SCALE)
    for window in (None, 40):
        got = case.run(window, softcap=2.5, query_tile=query_tile,
                       key_tile_blocks=key_tile_blocks)  # fmt: skip
        assert_matches(got, case.reference(window, 2.5), torch.float32)


@needs_compiler
def test_decode_plan_softcap_and_no_softcap_differ_only_by_the_cap() -> None:
    # A plan made with a cap runs capped on every layer; a huge cap is the identity on these
    # scores (tanh(x) = x to fp32 rounding for |x| < 1e-3): the same as no cap to 1e-6.
    case = make_decode_case(heads=8, seed=9, query_scale=QUERY_SCALE)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.context_lens,
            case.scale)  # fmt: skip
    plan = DecodePlan(*args, softcap=2.0)
    for _ in range(2):
        got = plan.run(case.query, case.key_cache, case.value_cache)
        assert_matches(got, case.reference(None, 2.0), torch.float32)
    loose = DecodePlan(*args, softcap=1e5).run(case.query, case.key_cache, case.value_cache)
    plain = DecodePlan(*args).run(case.query, case.key_cache, case.value_cache)
    torch.testing.assert_close(loose, plain, atol=1e-6, rtol=1e-6)


@needs_compiler
def test_rejects_a_bad_softcap() -> None:
    case = make_decode_case(lengths=(5, 40))
    prefill = make_prefill_case(shapes=((0, 5),))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be > 0"):
            case.run(softcap=bad)
        with pytest.raises(ValueError, match="softcap must be > 0"):
            prefill.run(softcap=bad)


# --- the Triton kernel (interpreter) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "num_splits", "window"),
    [(torch.float32, 1, None), (torch.float32, 4, 33), (torch.bfloat16, 2, None),
     (torch.float16, 1, 8)],
    ids=["fp32", "fp32-split4-window", "bf16-split2", "fp16-window"],
)  # fmt: skip
def test_triton_softcap_mixed_batch(
    dtype: torch.dtype, num_splits: int, window: int | None, device: torch.device
) -> None:
    """Decodes, full prefills at page boundaries, a chunk and a long decode in one launch."""
    case = make_case(
        query_lens=[1, 15, 17, 7, 1], context_lens=[17, 15, 40, 100, 300], kv_heads=2, group=4,
        head_dim=64, dtype=dtype, device=device, seed=2,
    )  # fmt: skip
    case.query = (case.query.float() * QUERY_SCALE).to(dtype)
    out = _run(case, num_splits=num_splits, window=window, softcap=2.0)
    _check(case, out, window=window, softcap=2.0)
    assert_cap_matters(out.double(), _run(case, num_splits=num_splits, window=window).double())


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_softcap_decode_head_dim_256(num_splits: int, device: torch.device) -> None:
    case = make_case(query_lens=[1, 1, 1], context_lens=[16, 17, 130], kv_heads=1, group=4,
                     head_dim=256, dtype=torch.float32, device=device, seed=5)  # fmt: skip
    case.query = case.query * QUERY_SCALE
    _check(case, _run(case, num_splits=num_splits, softcap=4.0), softcap=4.0)


# --- the Triton backend (the CPU backend's test is in test_cpu_attention.py) --------------------


@pytest.mark.parametrize("window", [None, 12])
def test_triton_backend_softcap_equals_torch_backend(
    window: int | None, device: torch.device
) -> None:
    outs = []
    for impl, on in ((TorchAttentionBackend(), torch.device("cpu")),
                     (TritonAttentionBackend(), device)):  # fmt: skip
        cache, md, query, key, value = _mixed_step(torch.float32, 64, seed=12, device=on)
        outs.append(impl.forward(1, query * 3.0, key, value, cache, md, scale=0.125,
                                 sliding_window=window, softcap=2.0).cpu())  # fmt: skip
    want, got = outs
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
