"""The quantized matmul (``kernels/csrc/quant_matmul.cpp``) against a float64 reference.

For every GGUF type and every build target the CPU runs, both paths (gemv, tiled) and the
automatic choice: random valid blocks (random bytes for the integer parts, finite fp16 scales
of every kind: moderate, subnormal, zero, negative), random x, shapes around the tiles (M in
{1, 2, 3, 7, 16, 33}, N not a multiple of the column tile, K of one, two and many blocks), 1 and
2 threads. The bound: ``|y - x.double() @ W.double().T| <= K * 2**-23 * (|x| @ |W|.T)``, W the
float32 weights gguf-py dequantizes (any float32 summation order meets it).
``dequantize_rows`` equals ``gguf.quants.dequantize`` bit for bit. Tensors placed against
PROT_NONE guard pages (after and before) show that the kernel reads and writes nothing outside
them; bad input raises ``ValueError`` before native code.

The int8-activation path (``activations="int8"``), with and without AVX512-VNNI where the
avx512 build runs, its few-rows kernel at 1 to 8 rows and its chunked kernel beyond: its
quantization of x equals ``quantize_activations`` (torch) bit for bit, and its product is within
float32 rounding of its per-block combination of the float64 reference ``torch_quant_matmul_int8``:
``|y - ref| <= (2 K / block + 4) * 2**-23 * (|xq| @ (|A| + |B|).T)``, xq the dequantized codes of
x, A the weights' scale part (``d sc q``) and B their min part (``dmin m``, K-quants 4 and 5
only).
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

from asyncpaged.kernels import cpu_build
from asyncpaged.kernels import quant_matmul as qm

gguf = pytest.importorskip("gguf")

QTYPE_NAMES = tuple(qm.QTYPES)
ROWS = (1, 2, 3, 7, 16, 33)
COLS = (1, 5, 37)
EPS = 2.0**-23  # float32 machine epsilon: twice the unit roundoff


def _scale_offsets(name: str) -> tuple[int, ...]:
    """Byte offsets of the fp16 scales in a block of ``name``."""
    return {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]


def random_weight(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row_bytes] uint8 of random blocks with finite fp16 scales (a few subnormal or zero)."""
    q = qm.QTYPES[name]
    gen = np.random.default_rng(seed)
    num_blocks = n * (k // q.block_elems)
    blocks = gen.integers(0, 256, size=(num_blocks, q.block_bytes), dtype=np.uint8)
    for off in _scale_offsets(name):
        scale = gen.uniform(-1.0, 1.0, size=num_blocks).astype(np.float16)
        kind = gen.integers(0, 10, size=num_blocks)
        scale[kind == 0] = np.float16(0.0)
        scale[kind == 1] = np.float16(3e-6)  # subnormal in fp16
        scale[kind == 2] = np.float16(-6.1e-5)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def gguf_dequantize(w: torch.Tensor, name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[name]))


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    weights = torch.from_numpy(gguf_dequantize(w, name)).double()
    exact = x.double() @ weights.T
    bound = x.shape[1] * EPS * (x.double().abs() @ weights.abs().T)
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound).all()), f"{name}: worst err/bound {(err / bound).nan_to_num().max()}"


def _ks(name: str) -> tuple[int, ...]:
    block = qm.QTYPES[name].block_elems
    return (block, 2 * block, 640 if block == 32 else 1280)  # 640: not a multiple of 256


@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_dequantize_rows_is_gguf_bit_for_bit(name: str) -> None:
    for n, k in ((1, qm.QTYPES[name].block_elems), (9, 1024)):
        w = random_weight(name, n, k, seed=n)
        got = qm.dequantize_rows(w, name, k).numpy()
        want = gguf_dequantize(w, name)
        assert got.dtype == np.float32 and got.shape == (n, k)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("path", ["gemv", "tiled"])  # ("auto" picks one of them by rows)
@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_matches_float64(target: str, name: str, path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for k in _ks(name):
        for n in COLS:
            w = random_weight(name, n, k, seed=k + n)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                y = qm.quant_matmul(x, w, name, k, path=path, target=target, num_threads=1)
                assert_within_bound(y, x, w, name)


@pytest.mark.parametrize("path", ["gemv", "tiled"])
@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_two_threads(target: str, name: str, path: str) -> None:
    k = 512
    w = random_weight(name, 70, k, seed=3)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1)) * 10
    y = qm.quant_matmul(x, w, name, k, path=path, target=target, num_threads=2)
    assert_within_bound(y, x, w, name)
    one = qm.quant_matmul(x, w, name, k, path=path, target=target, num_threads=1)
    assert torch.equal(y, one)  # the split over N does not change any sum


@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_torch_fallback(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    k = _ks(name)[-1]
    w = random_weight(name, qm.FALLBACK_ROWS + 3, k, seed=5)  # more than one chunk of rows
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
    assert_within_bound(qm.torch_quant_matmul(x, w, name, k), x, w, name)
    monkeypatch.setattr(qm, "native_quant_matmul", lambda target=None: None)
    assert_within_bound(qm.quant_matmul(x, w, name, k), x, w, name)


def test_bad_input_never_reaches_native_code(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(target: str | None = None) -> None:
        raise AssertionError("native code reached with bad input")

    monkeypatch.setattr(qm, "native_quant_matmul", unreachable)
    k = 64
    w = random_weight("Q8_0", 4, k)
    x = torch.randn(2, k)
    shapes, kinds = "must be contiguous|must be a positive multiple", "must be a|must be one of"
    bad_calls: dict[str, tuple[str, Callable[[], object]]] = {
        "row bytes": (shapes, lambda: qm.quant_matmul(x, w[:, :-1].contiguous(), "Q8_0", k)),
        "k vs row bytes": (shapes, lambda: qm.quant_matmul(x[:, :32].contiguous(), w, "Q8_0", 32)),
        "k not a block multiple": (
            shapes,
            lambda: qm.quant_matmul(x[:, :48].contiguous(), w, "Q8_0", 48),
        ),
        "k zero": (shapes, lambda: qm.quant_matmul(x[:, :0], w[:, :0], "Q8_0", 0)),
        "x columns": (shapes, lambda: qm.quant_matmul(torch.randn(2, 96), w, "Q8_0", k)),
        "x not contiguous": (shapes, lambda: qm.quant_matmul(torch.randn(k, 2).T, w, "Q8_0", k)),
        "w not contiguous": (
            shapes,
            lambda: qm.quant_matmul(x, torch.cat([w, w], dim=1)[:, : w.shape[1]], "Q8_0", k),
        ),
        "x dtype": (kinds, lambda: qm.quant_matmul(x.double(), w, "Q8_0", k)),
        "x bf16": (kinds, lambda: qm.quant_matmul(x.bfloat16(), w, "Q8_0", k)),
        "w dtype": (kinds, lambda: qm.quant_matmul(x, w.to(torch.int8), "Q8_0", k)),
        "x 1-D": (shapes, lambda: qm.quant_matmul(x[0], w, "Q8_0", k)),
        "w 1-D": (shapes, lambda: qm.quant_matmul(x, w.reshape(-1), "Q8_0", k)),
        "qtype": (kinds, lambda: qm.quant_matmul(x, w, "Q5_0", k)),
        "qtype kind": (kinds, lambda: qm.quant_matmul(x, w, 8, k)),  # type: ignore[arg-type]
        "Q4_K of Q8_0 bytes": (shapes, lambda: qm.quant_matmul(x, w, "Q4_K", k)),
        "path": (kinds, lambda: qm.quant_matmul(x, w, "Q8_0", k, path="fast")),
        "threads": ("num_threads", lambda: qm.quant_matmul(x, w, "Q8_0", k, num_threads=0)),
        "activations": (kinds, lambda: qm.quant_matmul(x, w, "Q8_0", k, activations="int4")),
        "int8 x dtype": (
            kinds,
            lambda: qm.quant_matmul(x.double(), w, "Q8_0", k, activations="int8"),
        ),
        "int8 threads": (
            "num_threads",
            lambda: qm.quant_matmul(x, w, "Q8_0", k, activations="int8", num_threads=0),
        ),
    }
    for what, (match, call) in bad_calls.items():
        with pytest.raises(ValueError, match=match):
            call()
            pytest.fail(f"accepted bad input: {what}")


def _vnni_modes(target: str) -> tuple[bool | None, ...]:
    """The int8 path's dot products to test on ``target``: VNNI only in the avx512 build."""
    if target == "avx512" and "avx512_vnni" in cpu_build.cpu_flags():
        return (None, False, True)
    return (None, False)


def weight_parts(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized weights split into (scale part, min part) in float64: W = A - B for Q4_K
    and Q5_K (A with dmin zeroed, B = -(W with d zeroed)), (W, 0) for the other types."""
    full = torch.from_numpy(gguf_dequantize(w, name)).double()
    if name not in ("Q4_K", "Q5_K"):
        return full, torch.zeros_like(full)
    blocks = w.numpy().reshape(-1, qm.QTYPES[name].block_bytes).copy()
    no_min, no_scale = blocks.copy(), blocks.copy()
    no_min[:, 2:4] = 0
    no_scale[:, 0:2] = 0
    shape = tuple(w.shape)
    a = gguf_dequantize(torch.from_numpy(no_min.reshape(shape)), name)
    b = gguf_dequantize(torch.from_numpy(no_scale.reshape(shape)), name)
    return torch.from_numpy(a).double(), -torch.from_numpy(b).double()


def assert_int8_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    q = qm.QTYPES[name]
    k = x.shape[1]
    codes, dx = qm.quantize_activations(x, q.block_elems)
    xq = codes.double().reshape(x.shape[0], -1, q.block_elems) * dx.double().unsqueeze(2)
    xq = xq.reshape(x.shape)
    a, b = weight_parts(w, name)
    exact = qm.torch_quant_matmul_int8(x, w, name, k).double()
    bound = (2 * k // q.block_elems + 4) * EPS * (xq.abs() @ (a.abs() + b.abs()).T)
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= bound).all()), f"{name}: worst err/bound {(err / bound).nan_to_num().max()}"


def test_quantize_activations_native_is_torch_bit_for_bit(target: str) -> None:
    op = qm.native_quant_matmul(target)
    assert op is not None
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 512, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0]).reshape(5, 1)
    x[4, :256] = 0.0  # an all-zero block: dx = 0, codes 0
    x[1, 3] = 127.0 * 2.5 / 127.0  # with max 127: x * (1 / dx) lands on (or next to) .5
    x[1, 7] = -127.0
    x[1, 8] = 3.5
    for block in (32, 256):
        codes, dx = op.quantize(x, block)
        want_codes, want_dx = qm.quantize_activations(x, block)
        assert torch.equal(codes, want_codes) and torch.equal(dx, want_dx)
        assert int(codes.abs().max()) <= 127
        assert bool((dx[4, : 256 // block] == 0).all())


@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_int8_matches_reference(target: str, name: str) -> None:
    op = qm.native_quant_matmul(target)
    assert op is not None
    q = qm.QTYPES[name]
    gen = torch.Generator().manual_seed(0)
    for k in _ks(name):
        for n in (*COLS, 16, 33):
            w = random_weight(name, n, k, seed=k + n)
            for m in (*ROWS, 9):
                x = torch.randn(m, k, generator=gen) * 4
                for vnni in _vnni_modes(target):
                    assert_int8_within_bound(op.int8(x, w, q, k, 1, vnni), x, w, name)
    x = torch.randn(3, k, generator=gen)
    y = qm.quant_matmul(x, w, name, k, activations="int8", target=target, num_threads=1)
    assert_int8_within_bound(y, x, w, name)


@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_int8_few_rows(target: str, name: str) -> None:
    """The few-rows kernel (1 to 8 rows of x, every build but baseline): N not a multiple of its
    16 rows of W per work item, K of one block and of 20 blocks (two groups of 8 plus 4 for
    the 32-element types), and 2 threads giving 1 thread's result."""
    op = qm.native_quant_matmul(target)
    assert op is not None
    q = qm.QTYPES[name]
    gen = torch.Generator().manual_seed(4)
    for k in (q.block_elems, 20 * q.block_elems if q.block_elems == 32 else 3 * q.block_elems):
        w = random_weight(name, 19, k, seed=k)
        for m in range(1, 9):
            x = torch.randn(m, k, generator=gen) * 3
            for vnni in _vnni_modes(target):
                y = op.int8(x, w, q, k, 1, vnni)
                assert_int8_within_bound(y, x, w, name)
                assert torch.equal(op.int8(x, w, q, k, 2, vnni), y)
    # large enough for 2 threads to split it (2 x 2^21 weight elements x rows)
    k = 2048
    w = random_weight(name, 2100, k, seed=5)
    x = torch.randn(2, k, generator=gen)
    y = op.int8(x, w, q, k, 1, None)
    assert_int8_within_bound(y, x, w, name)
    assert torch.equal(op.int8(x, w, q, k, 2, None), y)


def test_int8_vnni_refused_where_absent(target: str) -> None:
    op = qm.native_quant_matmul(target)
    assert op is not None
    if True in _vnni_modes(target):
        pytest.skip("this build runs VNNI here")
    w = random_weight("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="inconsistent"):
        op.int8(torch.randn(2, 64), w, qm.QTYPES["Q8_0"], 64, 1, True)


@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_int8_two_threads(target: str, name: str) -> None:
    k = 512
    w = random_weight(name, 70, k, seed=3)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(1)) * 10
    kw = {"activations": "int8", "target": target}
    y = qm.quant_matmul(x, w, name, k, num_threads=2, **kw)
    assert_int8_within_bound(y, x, w, name)
    assert torch.equal(y, qm.quant_matmul(x, w, name, k, num_threads=1, **kw))


@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_int8_torch_fallback(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    k = _ks(name)[-1]
    w = random_weight(name, qm.FALLBACK_ROWS + 3, k, seed=5)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
    want = qm.torch_quant_matmul_int8(x, w, name, k)
    assert_int8_within_bound(want, x, w, name)
    monkeypatch.setattr(qm, "native_quant_matmul", lambda target=None: None)
    assert torch.equal(qm.quant_matmul(x, w, name, k, activations="int8"), want)


_GUARDED_SCRIPT = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np, torch
    from asyncpaged.kernels import cpu_build, quant_matmul as qm
    sys.path.insert(0, {tests!r})
    from kernels.test_quant_matmul import (
        assert_int8_within_bound, assert_within_bound, random_weight)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE
    keep = []

    def guarded(num_bytes, at_end):
        # num_bytes of fresh memory ending right before (at_end) or starting right after a
        # PROT_NONE page.
        span = (num_bytes + PAGE - 1) // PAGE * PAGE
        base = libc.mmap(None, span + PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        guard = base + span if at_end else base
        assert libc.mprotect(guard, PAGE, 0) == 0, ctypes.get_errno()  # PROT_NONE
        start = base + span - num_bytes if at_end else base + PAGE
        keep.append(base)
        return start

    def place(t, at_end):
        addr = guarded(t.numel() * t.element_size(), at_end)
        ctypes.memmove(addr, t.data_ptr(), t.numel() * t.element_size())
        return addr

    lib = cpu_build.load_library({target!r})
    fn = lib.asyncpaged_quant_matmul
    fn.restype = ctypes.c_int32
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn.argtypes = [p, i64, i64, p, i64, i64, i32, p, i32, i32]
    fn8 = lib.asyncpaged_quant_matmul_int8
    fn8.restype = ctypes.c_int32
    fn8.argtypes = [p, i64, i64, p, i64, i64, i32, p, i32, i32]
    vnni_modes = (-1, 0)
    runs = 0
    for name, q in qm.QTYPES.items():
        for k in (q.block_elems, 5 * q.block_elems):
            for n in (1, 3, 37):
                w = random_weight(name, n, k, seed=n)
                for m in (1, 3, 13):
                    x = torch.randn(m, k)
                    for at_end in (True, False):
                        xp, wp = place(x, at_end), place(w, at_end)
                        yp = guarded(m * n * 4, at_end)
                        for path in (1, 2):
                            status = fn(xp, m, k, wp, n, w.shape[1], q.ggml_type, yp, path, 1)
                            assert status == 0, status
                            y = np.ctypeslib.as_array((ctypes.c_float * (m * n)).from_address(yp))
                            y = torch.from_numpy(y.copy()).reshape(m, n)
                            assert_within_bound(y, x, w, name)
                            runs += 1
                        for vnni in vnni_modes:
                            status = fn8(xp, m, k, wp, n, w.shape[1], q.ggml_type, yp, vnni, 1)
                            assert status == 0, status
                            y = np.ctypeslib.as_array((ctypes.c_float * (m * n)).from_address(yp))
                            y = torch.from_numpy(y.copy()).reshape(m, n)
                            assert_int8_within_bound(y, x, w, name)
                            runs += 1
    print("runs", runs)
    """
)


def test_no_access_outside_the_tensors(target: str) -> None:
    """x, W and y each end right before (and then start right after) a PROT_NONE page: a read
    or write past either end kills the child process (both paths and the int8 path)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _GUARDED_SCRIPT.format(tests=tests, target=target)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "runs 720" in done.stdout
