"""Which exact CPU levers an engine uses, decided at start on the CPU it runs on.

The levers (docs/tuning.md) may change speed, never tokens. Whether a lever keeps the reference
path's bits is checked on this CPU, not assumed from its flags (``lever_checks``: the same
oneDNN build with the same flags is bit-identical on one CPU and not on another), and whether it
is faster is timed. So each lever is ``"auto"`` by default (``EngineConfig``), and ``plan_cpu``
turns it into on or off with a reason:

==================  ==========================================================================
lever               ``"auto"`` means on when
==================  ==========================================================================
packed_linears      this torch has oneDNN's packed linear for the model's dtype, the packed
                    GEMMs (with and without a bias) are bit-identical to ``F.linear`` at the
                    row counts the engine runs (1 to ``max_num_batched_tokens``), and a timed
                    GEMM at the model's decode shape (64 rows) runs faster packed
screened_lm_head    float32 models: the CPU has bf16 dot products (flags), the screened head
                    picks the float32 head's argmax on random rows at the model's shape, and,
                    timed there, beats the fp32 head's argmax by ``SCREEN_MIN_SPEEDUP`` (this
                    catches emulation, e.g. ``ONEDNN_MAX_CPU_ISA``)
int8_lm_head        float32 models: oneDNN's int8 sums check exact here, with 8-bit activations
                    (VNNI) or 7-bit ones (``lm_head_int8.int8_activation_limit``), the
                    int8-screened head picks the float32 head's argmax, and, timed, beats the
                    fp32 head's argmax by ``SCREEN_MIN_SPEEDUP``
fused_elementwise   the native kernel library builds here and each fused op is bit-identical to
                    the model's torch op (float32: checked; bfloat16: the norm's sum order
                    differs by construction, so off)
native_bf16_decode  never: a bfloat16 model's decodes on the native kernel (fp32 math) are not
                    the bits of torch's bf16 SDPA, which transformers calls; off, they take that
                    SDPA per sequence (``CpuAttentionBackend.sdpa_bf16_decode``)
==================  ==========================================================================

``True`` / ``False`` force a lever (the reason says so): forcing an inexact lever on trades
transformers' bits for its speed. The native attention kernels' build target (the best the CPU
runs, ``ASYNCPAGED_CPU_TARGET`` overrides) and the torch thread count are reported too. Checks
and timings take about a second at a small model's shapes (more for a large vocabulary) and are
cached in the kernel cache directory (``cpu_plan.json``), keyed by the CPU model, its flags, the
torch and asyncpaged versions, the probes' revision, the oneDNN ISA cap, the thread count and the
shapes, so a restart on the same machine checks and times nothing. A result that is simply "not
on this CPU" is an INFO line (``cpu_plan``), never a warning.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from asyncpaged._log import get_logger
from asyncpaged.model.lever_checks import (
    FUSED_BF16_INEXACT,
    NATIVE_BF16_DECODE_INEXACT,
    Checker,
    ExactnessCheck,
    check_lever,
)
from asyncpaged.versions import __version__

log = get_logger(__name__)

LeverSetting = bool | Literal["auto"]
LEVERS = ("packed_linears", "screened_lm_head", "int8_lm_head", "fused_elementwise",
          "native_bf16_decode")  # fmt: skip
# A screened argmax (rescore included) must beat the fp32 head's by this much. The fp32 head it
# is timed against is the one the engine would run instead: oneDNN's packed layout where this
# torch has it (the runner packs the head when no bf16 screen runs), else F.linear.
SCREEN_MIN_SPEEDUP = 1.1
DECODE_ROWS = 64  # rows of the timed GEMMs: a decode step of a busy engine
# Part of every cached result's key: bump it when a probe's candidate, baseline or check changes
# (3: exactness checks; 4: each layer shape, small row counts repeated), so a cache from older
# code is not read as this one's.
PROBE_REVISION = 4
PACKED_PROBES = {torch.bfloat16: "packed_linear_bf16"}  # the float32 one is "packed_linear"
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86; "bf16" on aarch64
_VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
_VECTOR_FLAG = re.compile(r"(avx|fma|amx|asimd|sve|sme\d*$|.*vnni|.*bf16|.*fp16)")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """What the plan reads of the CPU: its architecture, model name and feature flags."""

    arch: str
    model_name: str
    flags: frozenset[str]

    @classmethod
    def detect(cls) -> CpuFeatures:
        """This machine's (``/proc/cpuinfo``; empty flags where there is none)."""
        flags: frozenset[str] = frozenset()
        name = ""
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "model name" and not name:
                name = value.strip()
            elif key in ("flags", "features") and not flags:  # x86 / aarch64
                flags = frozenset(value.split())
        machine = platform.machine().lower()
        return cls(machine, name or platform.processor() or machine, flags)

    def vector_flags(self) -> tuple[str, ...]:
        """The flags that name vector units (SIMD widths, FMA, AMX, VNNI, bf16/fp16 dot
        products, aarch64's asimd/sve), sorted: what benchmarks record beside every number."""
        return tuple(sorted(f for f in self.flags if _VECTOR_FLAG.match(f)))

    @property
    def has_bf16_dot(self) -> bool:
        return bool(self.flags & _BF16_FLAGS)

    @property
    def has_vnni(self) -> bool:
        return bool(self.flags & _VNNI_FLAGS)


@dataclass(frozen=True, slots=True)
class LeverChoice:
    enabled: bool
    reason: str


@dataclass(frozen=True, slots=True)
class CpuPlan:
    """The levers an engine runs with on this CPU, each with why (logged as ``cpu_plan``)."""

    packed_linears: LeverChoice
    screened_lm_head: LeverChoice
    int8_lm_head: LeverChoice
    fused_elementwise: LeverChoice
    native_bf16_decode: LeverChoice
    attention_target: str | None  # the native kernels' build target; None: no library
    num_threads: int
    cpu: str
    flags: tuple[str, ...] = field(default=())  # the flags the decisions read
    dtype: str = "float32"  # the model's

    def levers(self) -> dict[str, bool]:
        """The ``ModelRunner`` keyword arguments."""
        return {name: getattr(self, name).enabled for name in LEVERS}


Timer = Callable[[str, Mapping[str, int]], tuple[float, float]]


def plan_cpu(
    settings: Mapping[str, LeverSetting],
    *,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    head_dim: int = 64,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    linear_shapes: Sequence[tuple[int, int, bool]] = (),
    features: CpuFeatures | None = None,
    timer: Timer | None = None,
    checker: Checker | None = None,
    int8_exact: Callable[[], bool] | None = None,
    library_target: Callable[[], str | None] | None = None,
    cache: Path | Literal[False] | None = None,
    dtype: torch.dtype = torch.float32,
) -> CpuPlan:
    """Decide every lever of ``settings`` (name -> True / False / "auto").

    The model's sizes and ``dtype`` (float32 or bfloat16) fix the timed and checked shapes:
    packing is checked at every ``linear_shapes`` entry (``(in, out, has_bias)``, the model's
    layers; default: its MLP's up projection) up to ``max_num_batched_tokens`` rows, and at the
    LM head's up to ``max_num_seqs`` rows. ``features``, ``timer`` (name, shape ->
    seconds of (candidate, baseline)), ``checker`` (name, shape -> ``ExactnessCheck``),
    ``int8_exact`` and ``library_target`` default to this machine's; tests pass forced ones.
    ``cache`` (default: ``cpu_plan.json`` in the kernel cache) keeps results across restarts;
    ``False`` keeps them for this call only."""
    features = CpuFeatures.detect() if features is None else features
    shapes = {"rows": DECODE_ROWS, "hidden": hidden_size, "inter": intermediate_size,
              "vocab": vocab_size}  # fmt: skip
    checked = {"rows": max_num_batched_tokens, "hidden": hidden_size,
               "inter": intermediate_size, "vocab": vocab_size, "head_dim": head_dim}  # fmt: skip
    layers = tuple(linear_shapes) or ((hidden_size, intermediate_size, False),)
    packed_shapes = [{"rows": max_num_batched_tokens, "in": i, "out": o, "bias": int(b)}
                     for i, o, b in layers]  # fmt: skip
    packed_shapes.append({"rows": min(max_num_seqs, max_num_batched_tokens), "in": hidden_size,
                          "out": vocab_size, "bias": 0})  # the packed LM head  # fmt: skip
    timings = _ProbeCache(features, cache if cache is not None else _default_cache(),
                          timer or measure, checker or check_lever, checked)  # fmt: skip
    target = (library_target or _library_target)()
    name = str(dtype).removeprefix("torch.")
    packed = _packed(settings["packed_linears"], timings, shapes, packed_shapes, dtype)
    choices = {"packed_linears": packed}
    if dtype == torch.float32:
        choices.update({
            "screened_lm_head": _bf16_screen(settings["screened_lm_head"], features, timings,
                                             shapes),
            "int8_lm_head": _int8_screen(settings["int8_lm_head"], features, int8_exact, timings,
                                         shapes),
        })  # fmt: skip
    else:
        float32_only = LeverChoice(False, f"acts on float32 models; this one is {name}")
        choices.update(dict.fromkeys(("screened_lm_head", "int8_lm_head"), float32_only))
    choices["fused_elementwise"] = _fused(settings["fused_elementwise"], target, timings, dtype)
    choices["native_bf16_decode"] = _native_decode(settings["native_bf16_decode"], target, dtype)
    timings.save()
    read = sorted(features.flags & (_BF16_FLAGS | _VNNI_FLAGS | {"avx2", "avx512f", "fma"}))
    plan = CpuPlan(**choices, attention_target=target, num_threads=torch.get_num_threads(),
                   cpu=features.model_name, flags=tuple(read), dtype=name)  # fmt: skip
    decisions = {k: f"{'on' if c.enabled else 'off'}: {c.reason}" for k, c in choices.items()}
    log.info("cpu_plan", cpu=plan.cpu, flags=list(plan.flags), dtype=name,
             attention_target=target, num_threads=plan.num_threads, **decisions)  # fmt: skip
    return plan


def _forced(setting: LeverSetting) -> LeverChoice | None:
    if setting == "auto":
        return None
    return LeverChoice(bool(setting), f"{'on' if setting else 'off'} in EngineConfig")


def _packed(
    setting: LeverSetting,
    timings: _ProbeCache,
    shapes: dict[str, int],
    checked: Sequence[Mapping[str, int]],
    dtype: torch.dtype,
) -> LeverChoice:
    from asyncpaged.model.packed_linear import can_pack, packing_supported

    forced = _forced(setting)
    if forced is not None:
        return forced
    if not packing_supported():
        return LeverChoice(False, "this torch build has no oneDNN packed linear")
    name = str(dtype).removeprefix("torch.")
    if dtype != torch.float32 and not can_pack(dtype):
        return LeverChoice(False, f"oneDNN cannot pack {name} weights on this CPU")
    probe = "packed_linear" if dtype == torch.float32 else PACKED_PROBES[dtype]
    for layer in checked:  # every layer shape and the head: stop at the first inexact one
        check = timings.exactness(probe, layer)
        if not check.exact:
            return LeverChoice(False, f"not exact here: {check.detail}")
    check = ExactnessCheck(True, f"bit-identical to F.linear at the model's {len(checked)} layer "
                                 f"and head shapes, up to {checked[0]['rows']} rows")  # fmt: skip
    packed, plain = timings.get(probe, shapes)
    wins = packed < plain
    return LeverChoice(wins, f"{check.detail}; packed {packed * 1e3:.2f} ms vs F.linear "
                             f"{plain * 1e3:.2f} ms per [{shapes['rows']} x {shapes['hidden']}] "
                             f"{name} GEMM")  # fmt: skip


def _bf16_screen(
    setting: LeverSetting, features: CpuFeatures, timings: _ProbeCache, shapes: dict[str, int]
) -> LeverChoice:
    forced = _forced(setting)
    if forced is not None:
        return forced
    if not features.has_bf16_dot:
        return LeverChoice(False, "no bf16 dot products on this CPU (avx512_bf16, AMX, bf16): "
                                  "oneDNN would emulate them")  # fmt: skip
    check = timings.exactness("bf16_head", timings.checked_shapes)
    if not check.exact:
        return LeverChoice(False, f"not exact here: {check.detail}")
    bf16, fp32 = timings.get("bf16_head", shapes)
    speedup = fp32 / max(bf16, 1e-9)
    return LeverChoice(speedup >= SCREEN_MIN_SPEEDUP,
                       f"{check.detail}; the screened head {speedup:.2f}x as fast as the fp32 "
                       f"head (on from {SCREEN_MIN_SPEEDUP}x)")  # fmt: skip


def _int8_screen(
    setting: LeverSetting,
    features: CpuFeatures,
    int8_exact: Callable[[], bool] | None,
    timings: _ProbeCache,
    shapes: dict[str, int],
) -> LeverChoice:
    forced = _forced(setting)
    if forced is not None:
        return forced
    if int8_exact is None:  # this machine's check: which activation range sums exactly
        from asyncpaged.model.lm_head_int8 import ACTIVATION_LIMITS, int8_activation_limit

        limit = int8_activation_limit()
        exact, wide = limit is not None, limit == ACTIVATION_LIMITS[0]
    else:  # a forced answer (tests): the range follows the flags
        exact, wide = int8_exact(), features.has_vnni
    if not exact:
        return LeverChoice(False, "oneDNN's int8 GEMM failed its exactness check here")
    check = timings.exactness("int8_head", timings.checked_shapes)
    if not check.exact:
        return LeverChoice(False, f"not exact here: {check.detail}")
    int8, fp32 = timings.get("int8_head", shapes)
    speedup = fp32 / max(int8, 1e-9)
    sums = ("8-bit activations" if wide
            else "7-bit activations (no VNNI: 8-bit pair sums would saturate int16)")  # fmt: skip
    return LeverChoice(speedup >= SCREEN_MIN_SPEEDUP,
                       f"{sums}, int8 sums checked exact, {check.detail}; the int8-screened head "
                       f"{speedup:.2f}x as fast as the fp32 head (on from "
                       f"{SCREEN_MIN_SPEEDUP}x)")  # fmt: skip


def _fused(
    setting: LeverSetting, target: str | None, timings: _ProbeCache, dtype: torch.dtype
) -> LeverChoice:
    forced = _forced(setting)
    if forced is not None:
        return forced
    if target is None:
        return LeverChoice(False, "the native kernel library does not build here (no g++?)")
    if dtype != torch.float32:
        return LeverChoice(False, f"not exact: {FUSED_BF16_INEXACT}")
    check = timings.exactness("fused", timings.checked_shapes)
    if not check.exact:
        return LeverChoice(False, f"not exact here: {check.detail}")
    return LeverChoice(True, f"native kernels built for {target}; {check.detail}")


def _native_decode(setting: LeverSetting, target: str | None, dtype: torch.dtype) -> LeverChoice:
    forced = _forced(setting)
    if forced is not None:
        return forced
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        return LeverChoice(False, f"acts on bfloat16 models; this one is {name}")
    if target is None:
        return LeverChoice(False, "the native kernel library does not build here (no g++?)")
    return LeverChoice(False, f"not exact: {NATIVE_BF16_DECODE_INEXACT}")


def _library_target() -> str | None:
    from asyncpaged.kernels import cpu_build

    target = cpu_build.select_target()
    return target if cpu_build.load_library(target) is not None else None


def _default_cache() -> Path:
    from asyncpaged.kernels import cpu_build

    directory: Path = cpu_build.cache_dir()
    return directory / "cpu_plan.json"


class _ProbeCache:
    """Timings and exactness checks by (CPU, versions, probe revision, ISA cap, thread count,
    probe, shapes), read from and saved to ``path``."""

    def __init__(
        self,
        features: CpuFeatures,
        path: Path | Literal[False],
        timer: Timer,
        checker: Checker,
        checked_shapes: Mapping[str, int],
    ) -> None:
        self._path = path
        self._timer = timer
        self._checker = checker
        self.checked_shapes = dict(checked_shapes)  # the model's: the heads' and fused checks
        self._prefix = json.dumps([features.model_name, sorted(features.flags), torch.__version__,
                                   __version__, PROBE_REVISION,
                                   os.environ.get("ONEDNN_MAX_CPU_ISA", "")])  # fmt: skip
        self._entries: dict[str, Any] = {}
        self._dirty = False
        if path is not False and path.is_file():
            try:
                self._entries = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                self._entries = {}

    def get(self, probe: str, shapes: Mapping[str, int]) -> tuple[float, float]:
        """Seconds of (candidate, baseline) for timing ``probe`` at ``shapes``."""
        key = f"{self._prefix}|{probe}|{json.dumps(dict(sorted(shapes.items())))}"
        if key not in self._entries:
            self._entries[key] = list(self._timer(probe, shapes))
            self._dirty = True
        candidate, baseline = self._entries[key]
        return float(candidate), float(baseline)

    def exactness(self, probe: str, shapes: Mapping[str, int]) -> ExactnessCheck:
        """The exactness check of ``probe`` at ``shapes``, at this thread count (oneDNN may
        split a GEMM's sums by threads)."""
        key = (f"{self._prefix}|exact:{probe}|{torch.get_num_threads()}|"
               f"{json.dumps(dict(sorted(shapes.items())))}")  # fmt: skip
        if key in self._entries:
            try:
                return ExactnessCheck.from_json(self._entries[key])
            except ValueError:  # a damaged entry: check again
                pass
        check = self._checker(probe, shapes)
        self._entries[key] = check.to_json()
        self._dirty = True
        return check

    def save(self) -> None:
        if self._path is False or not self._dirty:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._entries))
            os.replace(tmp, self._path)
        except OSError as exc:  # a read-only cache only costs the timing next time
            log.info("cpu_plan_not_cached", path=str(self._path), error=str(exc))


def measure(probe: str, shapes: Mapping[str, int]) -> tuple[float, float]:
    """Best-of seconds of (candidate, baseline) for ``probe``: "packed_linear" (oneDNN packed vs
    ``F.linear``, the MLP up projection; "packed_linear_bf16" in bfloat16), "bf16_head" or
    "int8_head" (the bf16- or int8-screened greedy head vs the fp32 head's argmax, packed where
    this torch packs). Timed on one thread: a lever's win is per core, and on a shared VM a
    second thread's stalls would swamp it (docs/tuning.md, "Threads")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(probe, shapes)
    finally:
        torch.set_num_threads(threads)


def _measure(probe: str, shapes: Mapping[str, int]) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    rows, hidden = shapes["rows"], shapes["hidden"]
    x = torch.randn(rows, hidden, generator=gen)
    with torch.inference_mode():
        if probe in ("packed_linear", *PACKED_PROBES.values()):
            from asyncpaged.model.packed_linear import linear, pack_linears

            dtype = next((d for d, p in PACKED_PROBES.items() if p == probe), torch.float32)
            x = x.to(dtype)
            plain = torch.nn.Linear(hidden, shapes["inter"], bias=False)
            plain.weight.data = torch.randn(shapes["inter"], hidden, generator=gen).to(dtype)
            packed = copy.deepcopy(plain)
            pack_linears(packed, batch_hint=rows)

            def candidate() -> object:
                return linear(packed, x)

            def baseline() -> object:
                return linear(plain, x)

        elif probe in ("bf16_head", "int8_head"):
            weight = torch.randn(shapes["vocab"], hidden, generator=gen) * hidden**-0.5
            candidate = _screened_argmax(probe, weight, x)
            baseline = _fp32_argmax(weight, x)
        else:
            raise ValueError(f"unknown probe {probe!r}")
        return _best_of(candidate), _best_of(baseline)


def _screened_argmax(probe: str, weight: torch.Tensor, x: torch.Tensor) -> Callable[[], object]:
    from asyncpaged.model.lm_head import ScreenedLMHead
    from asyncpaged.model.lm_head_int8 import (
        ACTIVATION_LIMITS,
        Int8ScreenedArgmax,
        int8_activation_limit,
    )

    head = ScreenedLMHead(weight)
    if probe == "bf16_head":
        return lambda: head.argmax(x)

    limit = int8_activation_limit()
    int8 = Int8ScreenedArgmax(weight, rescorer=head, activation_limit=limit or ACTIVATION_LIMITS[0])
    return lambda: int8.argmax(x)


def _fp32_argmax(weight: torch.Tensor, x: torch.Tensor) -> Callable[[], object]:
    from asyncpaged.kernels.cpu_argmax import argmax_rows
    from asyncpaged.model.packed_linear import pack_weight, packed_matmul

    packed = pack_weight(weight, DECODE_ROWS)
    if packed is None:
        return lambda: argmax_rows(torch.nn.functional.linear(x, weight))
    return lambda: argmax_rows(packed_matmul(x, packed))


def _best_of(fn: Callable[[], object], budget_s: float = 0.05, min_runs: int = 3) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    best, spent, runs = float("inf"), 0.0, 0
    while runs < min_runs or spent < budget_s:
        began = time.perf_counter()
        fn()
        took = time.perf_counter() - began
        best, spent, runs = min(best, took), spent + took, runs + 1
        if runs >= 50:
            break
    return best
