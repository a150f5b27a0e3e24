"""The scaled matmul (``kernels/csrc/scaled_matmul.cpp``) against a float64 reference.

For every code (int4, int8, fp8 e4m3), scale dtype (float32, bfloat16, float16), grouping
(groups of 32 and 64, one group per row, 2-D blocks, one scale for the tensor), symmetric and
asymmetric, every build target the CPU runs and both paths: random codes (every fp8 byte but
NaN, subnormals included), random scales (fp16 subnormal and huge ones included), shapes around
the tiles. The bound: ``|y - x.double() @ W.double().T| <= K * 2**-23 * (|x| @ |W|.T)``, W the
float32 weights compressed-tensors' ``dequantize`` gives (checked bit for bit against it). Tensors
against PROT_NONE guard pages show the kernel reads and writes nothing outside them; bad input
raises ``ValueError`` before native code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch

from asyncpaged.kernels import cpu_build
from asyncpaged.kernels import scaled_matmul as sm

ROWS = (1, 16, 33)  # one row, the gemv tile, past it
COLS = (37,)  # past the column tiles, not a multiple of them
EPS = 2.0**-23
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: (group_size, row_block) per strategy; None: K (one group per row), 0: N (one scale)
GROUPINGS = {
    "group32": (32, 1),
    "group64": (64, 1),
    "channel": (None, 1),
    "block": (64, 32),
    "tensor": (None, 0),
}


def random_layout(
    code: str,
    n: int,
    k: int,
    grouping: str,
    scale_dtype: torch.dtype,
    asymmetric: bool,
    seed: int = 0,
) -> tuple[torch.Tensor, sm.ScaledLayout]:
    """Random codes of ``n`` rows of ``k`` and their layout (scales in ``scale_dtype`` range,
    a few tiny or zero; zero points over the whole range)."""
    gen = torch.Generator().manual_seed(seed)
    group, row_block = GROUPINGS[grouping]
    group = k if group is None else group
    row_block = n if row_block == 0 else row_block
    bits = sm.CODES[code][1]
    w = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=gen)
    if code == "fp8_e4m3":
        w[(w & 0x7F) == 0x7F] ^= 1  # no NaN codes
    shape = (-(-n // row_block), -(-k // group))
    scales = torch.rand(shape, generator=gen) * 2 - 1
    kind = torch.randint(0, 10, shape, generator=gen)
    scales[kind == 0] = 0.0
    scales[kind == 1] = 3e-7 if scale_dtype == torch.float16 else 1e-30  # fp16 subnormal
    scales[kind == 2] = 300.0  # 255 * 300 overflows fp16: inf weights where it hits
    scales = scales.to(scale_dtype).float()
    zeros = None
    if asymmetric:
        zeros = torch.randint(0, 1 << bits, shape, generator=gen).float()
    layout = sm.ScaledLayout(
        code=code,
        in_features=k,
        scales=scales,
        zeros=zeros,
        group_size=group,
        row_block=row_block,
        scale_dtype=scale_dtype,
    )
    return w, layout


def assert_within_bound(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, layout: sm.ScaledLayout
) -> None:
    weights = sm.dequantize_codes(w, layout).double()
    finite = torch.isfinite(weights).all(dim=1)  # rows with an fp16 overflow: inf or NaN sums
    exact = x.double() @ weights[finite].T
    bound = layout.in_features * EPS * (x.double().abs() @ weights[finite].abs().T)
    err = (y[:, finite].double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    assert bool((err <= bound).all()), f"worst err/bound {(err / bound).nan_to_num().max()}"
    assert bool((~torch.isfinite(y[:, ~finite])).all() or x.abs().min() == 0)


def _cases() -> list[tuple[str, str, bool]]:
    cases = []
    for code in sm.CODES:
        for grouping in GROUPINGS:
            for asym in (False, True):
                if asym and (code == "fp8_e4m3" or grouping in ("block", "tensor")):
                    continue
                cases.append((code, grouping, asym))
    return cases


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize(("code", "grouping", "asym"), _cases(), ids=str)
def test_dequantize_is_compressed_tensors(
    code: str, grouping: str, asym: bool, scale_dtype: torch.dtype
) -> None:
    """``dequantize_codes`` is compressed-tensors' own ``dequantize``, bit for bit."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    n, k = 40, 128
    w, layout = random_layout(code, n, k, grouping, scale_dtype, asym, seed=7)
    strategy = {"group32": "group", "group64": "group"}.get(grouping, grouping)
    args = QuantizationArgs(
        num_bits=sm.CODES[code][1],
        type="float" if code == "fp8_e4m3" else "int",
        strategy=strategy,
        symmetric=not asym,
        group_size=layout.group_size if strategy == "group" else None,
        block_structure=[layout.row_block, layout.group_size] if strategy == "block" else None,
    )
    offset = 1 << (sm.CODES[code][1] - 1)
    codes = sm.unpack_codes(w, layout)
    q = codes if code == "fp8_e4m3" else (codes - offset).to(torch.int8)
    scale = layout.scales.to(scale_dtype)
    zp = None if layout.zeros is None else (layout.zeros - offset).to(torch.int8)
    if strategy == "tensor":
        scale = scale.reshape(1)
    want = dequantize(q, scale, zp, args).float()
    got = sm.dequantize_codes(w, layout)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=str)
@pytest.mark.parametrize(("code", "grouping", "asym"), _cases(), ids=str)
def test_matches_float64(
    target: str, code: str, grouping: str, asym: bool, scale_dtype: torch.dtype
) -> None:
    """The CPU's best build takes each path at every row count; the others take "auto" (the
    row counts span both of its paths), which keeps CI short."""
    best = cpu_build.supported_targets()[0]
    paths = ("gemv", "tiled") if target == best else ("auto",)
    gen = torch.Generator().manual_seed(0)
    for k in (320,):  # 5 groups of 64, 10 of 32, a partial 2-D block
        for n in COLS:
            w, layout = random_layout(code, n, k, grouping, scale_dtype, asym, seed=k + n)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                for path in paths:
                    y = sm.scaled_matmul(x, w, layout, path=path, target=target, num_threads=1)
                    assert_within_bound(y, x, w, layout)


@pytest.mark.parametrize("path", ["gemv", "tiled"])
@pytest.mark.parametrize("code", list(sm.CODES))
def test_two_threads(target: str, code: str, path: str) -> None:
    w, layout = random_layout(code, 70, 512, "group64", torch.bfloat16, code != "fp8_e4m3", 3)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1)) * 10
    y = sm.scaled_matmul(x, w, layout, path=path, target=target, num_threads=2)
    assert_within_bound(y, x, w, layout)
    one = sm.scaled_matmul(x, w, layout, path=path, target=target, num_threads=1)
    assert torch.equal(y, one)


@pytest.mark.parametrize("code", list(sm.CODES))
def test_torch_fallback(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w, layout = random_layout(code, sm.FALLBACK_ROWS + 40, 128, "block", torch.float16, False, 5)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    assert_within_bound(sm.torch_scaled_matmul(x, w, layout), x, w, layout)
    monkeypatch.setattr(sm, "native_scaled_matmul", lambda target=None: None)
    assert_within_bound(sm.scaled_matmul(x, w, layout), x, w, layout)


def test_bad_input_never_reaches_native_code(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(target: str | None = None) -> None:
        raise AssertionError("native code reached with bad input")

    monkeypatch.setattr(sm, "native_scaled_matmul", unreachable)
    w, good = random_layout("int4", 4, 64, "group32", torch.float32, True)
    x = torch.randn(2, 64)

    def with_(**changes: object) -> sm.ScaledLayout:
        fields = {f: getattr(good, f) for f in sm.ScaledLayout.__dataclass_fields__}
        return sm.ScaledLayout(**{**fields, **changes})

    bad_calls: dict[str, tuple[str, Callable[[], object]]] = {
        "code": ("code must be", lambda: sm.scaled_matmul(x, w, with_(code="int3"))),
        "k": ("in_features", lambda: sm.scaled_matmul(x, w, with_(in_features=48))),
        "group": ("group_size", lambda: sm.scaled_matmul(x, w, with_(group_size=48))),
        "group 16": ("group_size", lambda: sm.scaled_matmul(x, w, with_(group_size=16))),
        "scale dtype": (
            "scale_dtype",
            lambda: sm.scaled_matmul(x, w, with_(scale_dtype=torch.float64)),
        ),
        "row bytes": (
            "must be contiguous",
            lambda: sm.scaled_matmul(x, w[:, :-1].contiguous(), good),
        ),
        "int8 of int4 bytes": (
            "must be contiguous",
            lambda: sm.scaled_matmul(x, w, with_(code="int8")),
        ),
        "w dtype": ("must be a uint8", lambda: sm.scaled_matmul(x, w.to(torch.int8), good)),
        "scales shape": (
            "scales must have shape",
            lambda: sm.scaled_matmul(x, w, with_(scales=good.scales[:, :1].contiguous())),
        ),
        "scales dtype": (
            "scales must be",
            lambda: sm.scaled_matmul(x, w, with_(scales=good.scales.bfloat16())),
        ),
        "zeros shape": (
            "zeros must have shape",
            lambda: sm.scaled_matmul(x, w, with_(zeros=torch.zeros(4, 1))),
        ),
        "fp8 zeros": (
            "no zero points",
            lambda: sm.scaled_matmul(
                x, torch.zeros(4, 64, dtype=torch.uint8), with_(code="fp8_e4m3")
            ),
        ),
        "row block": ("row_block", lambda: sm.scaled_matmul(x, w, with_(row_block=0))),
        "x columns": ("x must be", lambda: sm.scaled_matmul(torch.randn(2, 96), w, good)),
        "x dtype": ("x must be", lambda: sm.scaled_matmul(x.double(), w, good)),
        "x not contiguous": ("x must be", lambda: sm.scaled_matmul(torch.randn(64, 2).T, w, good)),
        "path": ("path", lambda: sm.scaled_matmul(x, w, good, path="fast")),
        "threads": ("num_threads", lambda: sm.scaled_matmul(x, w, good, num_threads=0)),
    }
    for what, (match, call) in bad_calls.items():
        with pytest.raises(ValueError, match=match):
            call()
            pytest.fail(f"accepted bad input: {what}")


_GUARDED_SCRIPT = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np, torch
    from asyncpaged.kernels import cpu_build, scaled_matmul as sm
    sys.path.insert(0, {tests!r})
    from kernels.test_scaled_matmul import assert_within_bound, random_layout

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE
    keep = []

    def guarded(num_bytes, at_end):
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
        if t is None:
            return None
        addr = guarded(t.numel() * t.element_size(), at_end)
        ctypes.memmove(addr, t.data_ptr(), t.numel() * t.element_size())
        return addr

    lib = cpu_build.load_library({target!r})
    fn = lib.asyncpaged_scaled_matmul
    fn.restype = ctypes.c_int32
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn.argtypes = [p, i64, i64, p, i64, i64, i32, p, p, i64, i32, i64, i32, p, i32, i32]
    runs = 0
    for code in sm.CODES:
        for grouping, asym in (("group32", code != "fp8_e4m3"), ("block", False)):
            for k in (32, 160):
                for n in (1, 3, 37):
                    w, lay = random_layout(code, n, k, grouping, torch.bfloat16, asym, seed=n)
                    for m in (1, 3, 13):
                        x = torch.randn(m, k)
                        for at_end in (True, False):
                            xp, wp = place(x, at_end), place(w, at_end)
                            sp, zp = place(lay.scales, at_end), place(lay.zeros, at_end)
                            yp = guarded(m * n * 4, at_end)
                            for path in (1, 2):
                                status = fn(xp, m, k, wp, n, w.shape[1], sm.CODES[code][0], sp,
                                            zp, lay.num_groups, lay.group_shift, lay.row_block,
                                            1, yp, path, 1)
                                assert status == 0, status
                                y = np.ctypeslib.as_array(
                                    (ctypes.c_float * (m * n)).from_address(yp))
                                y = torch.from_numpy(y.copy()).reshape(m, n)
                                assert_within_bound(y, x, w, lay)
                                runs += 1
    print("runs", runs)
    """
)


def test_no_access_outside_the_tensors(target: str) -> None:
    """x, W, the scales, the zeros and y each end right before (and then start right after) a
    PROT_NONE page: a read or write past either end kills the child process."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _GUARDED_SCRIPT.format(tests=tests, target=target)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "runs 432" in done.stdout


@pytest.mark.parametrize("target", cpu_build.supported_targets())
@pytest.mark.parametrize("code", ["int4", "int8"])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_int8_activations_match_float64(target: str, code: str, grouping: str) -> None:
    """The int8-activations product against its float64 reference (float32 rounding of the
    per-block scaling and the sum over blocks only), and the reference against the exact product
    (the quantization of x: at most max|x| / 254 per element times the row's sum of |W|).
    K = 320: ten blocks of 32 (eight reduced together, two alone), five groups of 64."""
    for asym in (False, True) if grouping != "tensor" else (False,):
        w, layout = random_layout(code, 37, 320, grouping, torch.bfloat16, asym, seed=3)
        x = torch.randn(17, 320, generator=torch.Generator().manual_seed(4))
        x[3] = 0.0  # an all-zero row: dx 0
        x[5, :40] *= 50.0  # outliers
        y = sm.scaled_matmul(x, w, layout, target=target, activations="int8", num_threads=2)
        ref = sm.torch_scaled_matmul_int8(x, w, layout)
        mag = sm.torch_scaled_matmul_int8(x, w, layout, magnitude=True)
        num_blocks = 320 // sm.activation_block(layout)
        assert ((y.double() - ref).abs() <= (num_blocks + 2) * EPS * mag).all()
        weights = sm.dequantize_codes(w, layout).double()
        exact = x.double() @ weights.T
        bound = x.abs().amax(1, keepdim=True).double() / 254 * weights.abs().sum(1)[None]
        assert ((ref - exact).abs() <= bound * (1 + 1e-9) + 1e-300).all()


def test_int8_activation_blocks() -> None:
    w, layout = random_layout("int4", 4, 256, "group64", torch.float32, False)
    assert sm.activation_block(layout) == 64
    _, channel = random_layout("int4", 4, 256, "channel", torch.float32, False)
    assert sm.activation_block(channel) == 128
    _, narrow = random_layout("int8", 4, 96, "channel", torch.float32, False)
    assert sm.activation_block(narrow) == 32
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="activations must be"):
        sm.scaled_matmul(x, w, layout, activations="int4")
    fp8, fp8_layout = random_layout("fp8_e4m3", 4, 256, "channel", torch.float32, False)
    with pytest.raises(ValueError, match="int4 or int8 codes"):
        sm.scaled_matmul(x, fp8, fp8_layout, activations="int8")


def test_int8_activations_torch_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    w, layout = random_layout("int4", 8, 128, "group32", torch.float32, True)
    x = torch.randn(3, 128)
    monkeypatch.setattr(sm, "native_scaled_matmul", lambda target=None: None)
    y = sm.scaled_matmul(x, w, layout, activations="int8")
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), sm.torch_scaled_matmul_int8(x, w, layout))
