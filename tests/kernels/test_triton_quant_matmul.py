"""The Triton quantized matmuls (``kernels/triton_quant_matmul.py``) against float64 references,
under the interpreter on the CPU (natively on CUDA with ``ASYNCPAGED_KERNELS_NATIVE=1``).

Every GGUF type and every compressed-tensors layout (int4 / int8 / fp8 codes, grouped, per
channel, 2-D blocks, one scale; symmetric and asymmetric; float32, bfloat16 and float16 scales):
the decode equals ``dequantize_rows`` / ``dequantize_codes`` bit for bit, and the product meets
the CPU kernels' bound ``|y - x.double() @ W.double().T| <= K * 2**-23 * (|x| @ |W|.T)`` at
M in {1, 3, 17} (both GEMV widths and the ``tl.dot`` path), N = 37 (not a multiple of any column
tile) and K of one and several blocks. The interpreter does not catch reads out of bounds, so
every input is a view into a larger buffer poisoned past its end (NaN floats, 0xff bytes: a NaN
fp16 scale or fp8 code), and a read past the end would show up as NaN in the result; a read
past the end that could not change the result (a row of W or x beyond N or M) is caught by
placing the tensors right before a PROT_NONE page. The random data and the references are the
CPU kernels' tests' own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from asyncpaged.kernels import quant_matmul as qm
from asyncpaged.kernels import scaled_matmul as sm
from asyncpaged.kernels import triton_quant_matmul as tq
from asyncpaged.model.fp8_weight import FP8Weight
from asyncpaged.model.gguf_weight import GGUFWeight
from asyncpaged.model.packed_int_weight import PackedIntWeight
from asyncpaged.model.quantized_linear import attach_quantized, set_activations
from tests.kernels import test_quant_matmul as cpu_gguf
from tests.kernels import test_scaled_matmul as cpu_scaled
from tests.kernels.conftest import NATIVE

ROWS = (1, 3, 17)  # GEMV at one and at four rows wide, tl.dot tiles past GEMV_MAX_ROWS
COLS = 37
SCALE_DTYPES = cpu_scaled.SCALE_DTYPES


def poisoned(t: torch.Tensor, device: torch.device, *, extra_rows: int = 3) -> torch.Tensor:
    """``t`` on ``device`` as the first rows of a buffer whose later rows are NaN (floats) or
    0xff (bytes)."""
    fill = 255 if t.dtype == torch.uint8 else float("nan")
    buffer = torch.full((t.shape[0] + extra_rows, *t.shape[1:]), fill, dtype=t.dtype)
    buffer[: t.shape[0]] = t
    view = buffer.to(device)[: t.shape[0]]
    assert view.is_contiguous()
    return view


def poisoned_layout(layout: sm.ScaledLayout, device: torch.device) -> sm.ScaledLayout:
    zeros = None if layout.zeros is None else poisoned(layout.zeros, device)
    return sm.ScaledLayout(
        code=layout.code,
        in_features=layout.in_features,
        scales=poisoned(layout.scales, device),
        zeros=zeros,
        group_size=layout.group_size,
        row_block=layout.row_block,
        scale_dtype=layout.scale_dtype,
    )


def _gguf_ks(name: str) -> tuple[int, ...]:
    block = qm.QTYPES[name].block_elems
    return (block, 3 * block) if block == 256 else (block, 320)  # 320: ten blocks


@pytest.mark.parametrize("name", list(qm.QTYPES))
def test_gguf_dequantize_rows_is_bit_for_bit(name: str, device: torch.device) -> None:
    k = _gguf_ks(name)[-1]
    w = cpu_gguf.random_weight(name, COLS, k, seed=11)
    got = tq.triton_dequantize_rows(poisoned(w, device), name, k).cpu()
    want = qm.dequantize_rows(w, name, k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", list(qm.QTYPES))
def test_gguf_matmul_matches_float64(name: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    for k in _gguf_ks(name):
        w = cpu_gguf.random_weight(name, COLS, k, seed=k)
        w_device = poisoned(w, device)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            y = tq.triton_quant_matmul(poisoned(x, device), w_device, name, k)
            assert y.device == w_device.device
            cpu_gguf.assert_within_bound(y.cpu(), x, w, name)


def _layout_cases() -> list[tuple[str, str, bool, torch.dtype]]:
    """Each layout of the CPU tests once, the scale dtypes taken in turn (the decode test covers
    every layout at every scale dtype)."""
    return [
        (code, grouping, asym, SCALE_DTYPES[i % len(SCALE_DTYPES)])
        for i, (code, grouping, asym) in enumerate(cpu_scaled._cases())
    ]


def _all_layouts() -> list[tuple[str, str, bool, torch.dtype]]:
    return [(*case, dtype) for case in cpu_scaled._cases() for dtype in SCALE_DTYPES]


@pytest.mark.parametrize(("code", "grouping", "asym", "scale_dtype"), _all_layouts(), ids=str)
def test_codes_dequantize_is_bit_for_bit(
    code: str, grouping: str, asym: bool, scale_dtype: torch.dtype, device: torch.device
) -> None:
    w, layout = cpu_scaled.random_layout(code, COLS, 320, grouping, scale_dtype, asym, seed=7)
    got = tq.triton_dequantize_codes(poisoned(w, device), poisoned_layout(layout, device)).cpu()
    want = sm.dequantize_codes(w, layout)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize(("code", "grouping", "asym", "scale_dtype"), _layout_cases(), ids=str)
def test_scaled_matmul_matches_float64(
    code: str, grouping: str, asym: bool, scale_dtype: torch.dtype, device: torch.device
) -> None:
    """K = 320: 5 groups of 64, 10 of 32, a partial 2-D block of rows."""
    gen = torch.Generator().manual_seed(0)
    w, layout = cpu_scaled.random_layout(code, COLS, 320, grouping, scale_dtype, asym, seed=3)
    w_device, layout_device = poisoned(w, device), poisoned_layout(layout, device)
    for m in ROWS:
        x = torch.randn(m, 320, generator=gen)
        # fp16 scales of 300 overflow some weights to inf on purpose: the interpreter's numpy
        # reports the inf - inf of those rows' sums, the GPU does not
        with np.errstate(invalid="ignore", over="ignore"):
            y = tq.triton_scaled_matmul(poisoned(x, device), w_device, layout_device)
        cpu_scaled.assert_within_bound(y.cpu(), x, w, layout)


def test_fp8_nan_codes_decode_to_nan(device: torch.device) -> None:
    w, layout = cpu_scaled.random_layout("fp8_e4m3", 4, 64, "channel", torch.bfloat16, False)
    w[:, :2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    got = tq.triton_dequantize_codes(w.to(device), layout.to(device)).cpu()
    assert torch.isnan(got[:, :2]).all() and torch.isfinite(got[:, 2:]).all()


def test_weights_dispatch_to_triton(device: torch.device) -> None:
    """``use_triton`` (the default on CUDA) sends the weights' products and a GGUF embedding's
    lookup to the Triton kernels; ``to`` moves a weight, keeping the CPU one as it is."""
    k = 64
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    raw = cpu_gguf.random_weight("Q4_0", COLS, k, seed=2)
    gguf = GGUFWeight(raw, "Q4_0", k).to(device)
    assert gguf.use_triton == (device.type == "cuda")
    gguf.use_triton = True
    cpu_gguf.assert_within_bound(gguf.matmul(x.to(device)).cpu(), x, raw, "Q4_0")
    ids = torch.tensor([5, 0, 36, 5])
    got = gguf.rows(ids.to(device)).cpu()
    assert torch.equal(got, qm.dequantize_rows(raw[ids], "Q4_0", k))
    cpu = GGUFWeight(raw, "Q4_0", k)
    assert not cpu.use_triton and cpu.to(torch.device("cpu")) is cpu
    for code, cls in (("int4", PackedIntWeight), ("fp8_e4m3", FP8Weight)):
        w, layout = cpu_scaled.random_layout(code, COLS, k, "group32", torch.bfloat16, False)
        weight = cls(w, layout).to(device)
        assert weight.use_triton == (device.type == "cuda")
        weight.use_triton = True
        cpu_scaled.assert_within_bound(weight.matmul(x.to(device)).cpu(), x, w, layout)


def test_int8_activations_are_refused_on_triton_weights() -> None:
    layer = nn.Linear(64, COLS, bias=False)
    raw = cpu_gguf.random_weight("Q8_0", COLS, 64)
    attach_quantized(layer, GGUFWeight(raw, "Q8_0", 64, use_triton=True))
    with pytest.raises(ValueError, match="runs on the CPU only"):
        set_activations(nn.Sequential(layer), "int8")
    assert set_activations(nn.Sequential(layer), "float32") == 1


def test_bad_input_raises_before_any_launch(device: torch.device) -> None:
    k = 64
    w = cpu_gguf.random_weight("Q8_0", 4, k).to(device)
    x = torch.randn(2, k, device=device)
    codes, layout = cpu_scaled.random_layout("int4", 4, k, "group32", torch.float32, True)
    codes, layout = codes.to(device), layout.to(device)
    bad_calls: dict[str, tuple[str, Callable[[], object]]] = {
        "qtype": ("qtype must be", lambda: tq.triton_quant_matmul(x, w, "Q2_K", k)),
        "row bytes": (
            "must be contiguous",
            lambda: tq.triton_quant_matmul(x, w[:, :-2], "Q8_0", k),
        ),
        "k": ("positive multiple", lambda: tq.triton_quant_matmul(x, w, "Q8_0", 48)),
        "x columns": ("x must be", lambda: tq.triton_quant_matmul(x[:, :32], w, "Q8_0", k)),
        "x dtype": ("x must be", lambda: tq.triton_quant_matmul(x.double(), w, "Q8_0", k)),
        "x device": ("x must be", lambda: tq.triton_quant_matmul(x.to("meta"), w, "Q8_0", k)),
        "w dtype": ("uint8", lambda: tq.triton_quant_matmul(x, w.to(torch.int8), "Q8_0", k)),
        "code rows": ("must be contiguous", lambda: tq.triton_scaled_matmul(x, codes.T, layout)),
        "scales device": (
            "scales must be",
            lambda: tq.triton_scaled_matmul(x, codes, layout.to(torch.device("meta"))),
        ),
        "x of codes": ("x must be", lambda: tq.triton_scaled_matmul(x[:, :32], codes, layout)),
    }
    for what, (match, call) in bad_calls.items():
        with pytest.raises(ValueError, match=match):
            call()
            pytest.fail(f"accepted bad input: {what}")


_GUARDED_SCRIPT = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np, torch
    sys.path.insert(0, {root!r})
    from asyncpaged.kernels import quant_matmul as qm, scaled_matmul as sm
    from asyncpaged.kernels import triton_quant_matmul as tq
    from tests.kernels import test_quant_matmul as cpu_gguf
    from tests.kernels import test_scaled_matmul as cpu_scaled

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE

    def guarded(t):
        # a copy of t in fresh memory that ends right before a PROT_NONE page
        num_bytes = t.numel() * t.element_size()
        span = (num_bytes + PAGE - 1) // PAGE * PAGE
        base = libc.mmap(None, span + PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        assert libc.mprotect(base + span, PAGE, 0) == 0, ctypes.get_errno()
        memory = (ctypes.c_uint8 * num_bytes).from_address(base + span - num_bytes)
        out = torch.frombuffer(memory, dtype=t.dtype).reshape(t.shape)
        out.copy_(t)
        return out

    runs = 0
    for name, q in qm.QTYPES.items():
        k = q.block_elems
        w = cpu_gguf.random_weight(name, 37, k, seed=1)
        gw = guarded(w)
        assert torch.equal(tq.triton_dequantize_rows(gw, name, k), qm.dequantize_rows(w, name, k))
        for m in (1, 3, 17):
            x = torch.randn(m, k)
            cpu_gguf.assert_within_bound(tq.triton_quant_matmul(guarded(x), gw, name, k), x, w,
                                         name)
            runs += 1
    for code, grouping, asym in (("int4", "group32", True), ("int8", "block", False),
                                 ("fp8_e4m3", "channel", False)):
        w, layout = cpu_scaled.random_layout(code, 37, 64, grouping, torch.float32, asym)
        zeros = None if layout.zeros is None else guarded(layout.zeros)
        gl = sm.ScaledLayout(code=code, in_features=64, scales=guarded(layout.scales),
                             zeros=zeros, group_size=layout.group_size,
                             row_block=layout.row_block, scale_dtype=torch.float32)
        gw = guarded(w)
        assert torch.equal(tq.triton_dequantize_codes(gw, gl), sm.dequantize_codes(w, layout))
        for m in (1, 3, 17):
            x = torch.randn(m, 64)
            cpu_scaled.assert_within_bound(tq.triton_scaled_matmul(guarded(x), gw, gl), x, w,
                                           layout)
            runs += 1
    print("runs", runs)
    """
)


@pytest.mark.skipif(NATIVE, reason="the guard pages are host memory: the interpreter's check")
def test_no_read_past_the_tensors() -> None:
    """x, W, scales and zeros each end right before a PROT_NONE page: a read past the end kills
    the child process (every GGUF type and code, both paths, the decodes)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    script = _GUARDED_SCRIPT.format(root=root)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, check=False, env=env)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "runs 24" in done.stdout
