"""The CPU plan: each lever decided from forced feature sets, exactness checks and timings,
cached, logged once; the engine runs with what it decided, and every lever combination keeps
greedy tokens exact."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.model import cpu_plan
from asyncpaged.model.cpu_plan import LEVERS, CpuFeatures, LeverSetting, plan_cpu
from asyncpaged.model.lever_checks import ExactnessCheck
from tests.model.driver import Driver
from tests.model.reference import HFReference
from tests.model.test_generate_equality import _assert_matches, _make_sequences, _runner

AUTO: dict[str, LeverSetting] = dict.fromkeys(LEVERS, "auto")
ZEN4 = CpuFeatures("x86_64", "AMD EPYC (Zen 4)",
                   frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}))  # fmt: skip
AVX2 = CpuFeatures("x86_64", "AMD EPYC (AVX2)", frozenset({"avx", "avx2", "fma"}))
ICELAKE = CpuFeatures("x86_64", "Xeon (Ice Lake)", frozenset({"avx2", "avx512f", "avx512_vnni"}))
GRAVITON3 = CpuFeatures("aarch64", "Neoverse-V1", frozenset({"asimd", "sve", "bf16", "i8mm"}))


class Timings:
    """A fake timer: (candidate, baseline) seconds per probe; records what it was asked."""

    def __init__(self, **results: tuple[float, float]) -> None:
        self.results = {"packed_linear": (1.0, 2.0), "packed_linear_bf16": (1.0, 2.0),
                        "bf16_head": (1.0, 3.0), "int8_head": (1.0, 4.0), **results}  # fmt: skip
        self.calls: list[str] = []

    def __call__(self, probe: str, shapes: Mapping[str, int]) -> tuple[float, float]:
        assert shapes == {"rows": 64, "hidden": 512, "inter": 1376, "vocab": 32000}
        self.calls.append(probe)
        return self.results[probe]


class Checks:
    """A fake exactness checker: every probe exact unless named inexact; records what it was
    asked."""

    def __init__(self, *inexact: str) -> None:
        self.inexact = set(inexact)
        self.calls: list[str] = []

    def __call__(self, probe: str, shapes: Mapping[str, int]) -> ExactnessCheck:
        if probe.startswith("packed_linear"):  # each layer shape (here the default: the MLP's
            assert shapes in (
                {"rows": 2048, "in": 512, "out": 1376, "bias": 0},  # up) and
                {"rows": 256, "in": 512, "out": 32000, "bias": 0},
            )  # the head
        else:
            assert shapes == {"rows": 2048, "hidden": 512, "inter": 1376, "vocab": 32000,
                              "head_dim": 64}  # fmt: skip
        self.calls.append(probe)
        if probe in self.inexact:
            return ExactnessCheck(False, f"{probe} differs")
        return ExactnessCheck(True, f"{probe} checked")


def _plan(
    features: CpuFeatures,
    timer: Timings,
    *,
    checks: Checks | None = None,
    settings: Mapping[str, LeverSetting] = AUTO,
    int8_exact: Callable[[], bool] = lambda: True,
    target: str | None = "avx2",
    cache: Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, bool]:
    plan = plan_cpu(
        settings, hidden_size=512, intermediate_size=1376, vocab_size=32000,
        features=features, timer=timer, checker=checks or Checks(), int8_exact=int8_exact,
        library_target=lambda: target, cache=False if cache is None else cache, dtype=dtype,
    )  # fmt: skip
    return plan.levers()


def test_features_decide_what_timing_cannot() -> None:
    timer = Timings()
    assert _plan(ZEN4, timer) == dict(dict.fromkeys(LEVERS, True), native_bf16_decode=False)
    assert sorted(timer.calls) == ["bf16_head", "int8_head", "packed_linear"]
    timer = Timings()
    # no bf16 dot products: no bf16 screen, not timed; no VNNI: the int8 screen on 7-bit
    # activations, timed (its exactness check decides whether it runs at all)
    avx2 = _plan(AVX2, timer)
    assert avx2 == {"packed_linears": True, "screened_lm_head": False, "int8_lm_head": True,
                    "fused_elementwise": True, "native_bf16_decode": False}  # fmt: skip
    assert timer.calls == ["packed_linear", "int8_head"]
    assert _plan(AVX2, Timings(), int8_exact=lambda: False)["int8_lm_head"] is False
    assert _plan(ICELAKE, Timings())["screened_lm_head"] is False  # VNNI, no bf16
    assert _plan(ICELAKE, Timings())["int8_lm_head"] is True
    assert _plan(GRAVITON3, Timings())["screened_lm_head"] is True  # aarch64 "bf16" flag
    assert _plan(AVX2, Timings(), target=None)["fused_elementwise"] is False  # no library


def test_timings_decide_where_features_allow() -> None:
    slow_screen = Timings(bf16_head=(2.0, 2.1))  # emulated bf16 (ONEDNN_MAX_CPU_ISA, ...)
    assert _plan(ZEN4, slow_screen)["screened_lm_head"] is False
    slow_packing = Timings(packed_linear=(2.0, 1.5))
    assert _plan(ZEN4, slow_packing)["packed_linears"] is False
    assert _plan(ZEN4, Timings(), int8_exact=lambda: False)["int8_lm_head"] is False
    slow_int8 = Timings(int8_head=(2.0, 2.1))  # a small head: the screen does not pay
    assert _plan(ZEN4, slow_int8)["int8_lm_head"] is False
    assert _plan(ZEN4, slow_int8)["screened_lm_head"] is True  # decided on its own timing


def test_a_bfloat16_model_times_bfloat16_packing_fuses_and_skips_the_screens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncpaged.model import packed_linear

    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype: True)
    monkeypatch.setattr(packed_linear, "packing_supported", lambda: True)
    timer, checks = Timings(), Checks()
    plan = plan_cpu(AUTO, hidden_size=512, intermediate_size=1376, vocab_size=32000,
                    features=ZEN4, timer=timer, checker=checks, int8_exact=lambda: True,
                    library_target=lambda: "avx512", cache=False,
                    dtype=torch.bfloat16)  # fmt: skip
    assert plan.dtype == "bfloat16"
    assert plan.levers() == {"packed_linears": True, "screened_lm_head": False,
                             "int8_lm_head": False, "fused_elementwise": False,
                             "native_bf16_decode": False}  # fmt: skip
    assert plan.native_bf16_decode.reason.startswith("not exact: the paged kernel's fp32 math")
    assert timer.calls == ["packed_linear_bf16"]  # its own probe: float32 timings don't tell
    # the layer shape and the head; the fused norm is inexact by construction, not checked
    assert checks.calls == ["packed_linear_bf16", "packed_linear_bf16"]
    assert plan.fused_elementwise.reason.startswith("not exact: the fused RMSNorm")
    assert plan.screened_lm_head.reason == "acts on float32 models; this one is bfloat16"
    assert plan.int8_lm_head.reason == "acts on float32 models; this one is bfloat16"
    slower = Timings(packed_linear_bf16=(2.0, 1.5), packed_linear=(1.0, 2.0))
    assert _plan(ZEN4, slower, dtype=torch.bfloat16)["packed_linears"] is False
    forced = dict(AUTO, screened_lm_head=True, int8_lm_head=True)
    assert _plan(ZEN4, Timings(), settings=forced, dtype=torch.bfloat16) == plan.levers()
    # oneDNN packs bfloat16 only where the CPU converts it natively (not AVX2-only): not timed
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype: dtype == torch.float32)
    timer = Timings()
    plan = plan_cpu(AUTO, hidden_size=512, intermediate_size=1376, vocab_size=32000,
                    features=AVX2, timer=timer, int8_exact=lambda: True,
                    library_target=lambda: "avx2", cache=False,
                    dtype=torch.bfloat16)  # fmt: skip
    assert plan.packed_linears.enabled is False
    assert plan.packed_linears.reason == "oneDNN cannot pack bfloat16 weights on this CPU"
    assert timer.calls == []
    assert _plan(AVX2, Timings())["packed_linears"] is True  # float32 packs there
    # where the packed bf16 GEMMs are not F.linear's bits (avx512 without bf16 dot products; a
    # bias on Emerald Rapids), the check turns packing off, whatever the flags, and nothing is
    # timed; the flags alone decide nothing
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype: True)
    timer = Timings()
    inexact = Checks("packed_linear_bf16")
    plan = plan_cpu(AUTO, hidden_size=512, intermediate_size=1376, vocab_size=32000,
                    features=ZEN4, timer=timer, checker=inexact, int8_exact=lambda: True,
                    library_target=lambda: "avx512", cache=False,
                    dtype=torch.bfloat16)  # fmt: skip
    assert plan.packed_linears == cpu_plan.LeverChoice(
        False, "not exact here: packed_linear_bf16 differs"
    )
    assert timer.calls == []
    assert _plan(ICELAKE, Timings(), dtype=torch.bfloat16)["packed_linears"] is True
    assert _plan(ICELAKE, Timings())["packed_linears"] is True


def test_explicit_settings_win_and_time_nothing() -> None:
    timer = Timings()
    settings: dict[str, LeverSetting] = {
        "packed_linears": False,
        "screened_lm_head": True,
        "int8_lm_head": True,
        "fused_elementwise": False,
        "native_bf16_decode": True,
    }
    checks = Checks()
    forced = _plan(AVX2, timer, settings=settings, checks=checks)
    assert forced == settings
    assert timer.calls == checks.calls == []


def test_timings_are_cached_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cpu_plan.json"
    first, first_checks = Timings(), Checks("fused")
    assert _plan(ZEN4, first, checks=first_checks, cache=cache)["fused_elementwise"] is False
    assert cache.is_file()
    assert len(first.calls) == 3
    assert sorted(first_checks.calls) == ["bf16_head", "fused", "int8_head", "packed_linear",
                                          "packed_linear"]  # fmt: skip
    again, again_checks = Timings(), Checks()
    # a restart on the same CPU times and checks nothing: the cached check still says inexact
    assert _plan(ZEN4, again, checks=again_checks, cache=cache)["fused_elementwise"] is False
    assert again.calls == again_checks.calls == []
    threads = torch.get_num_threads()
    try:  # another thread count: oneDNN may split sums otherwise, so checked again
        torch.set_num_threads(threads + 1)
        other_threads = Checks()
        _plan(ZEN4, Timings(), checks=other_threads, cache=cache)
        assert len(other_threads.calls) == 5
    finally:
        torch.set_num_threads(threads)
    other = Timings()
    _plan(ICELAKE, other, cache=cache)
    assert other.calls == ["packed_linear", "int8_head"]  # another CPU: its own entries
    monkeypatch.setattr(cpu_plan, "PROBE_REVISION", cpu_plan.PROBE_REVISION + 1)
    newer = Timings()
    _plan(ZEN4, newer, cache=cache)
    assert len(newer.calls) == 3  # timings of older probe code are not reused
    cache.write_text("not json")
    _plan(ZEN4, Timings(), cache=cache)  # a damaged cache is ignored and rewritten


def test_the_plan_is_logged_once_at_info_without_warnings() -> None:
    with capture_logs() as logs:
        plan_cpu(AUTO, hidden_size=512, intermediate_size=1376, vocab_size=32000,
                 features=AVX2, timer=Timings(), checker=Checks(),
                 library_target=lambda: "avx2", int8_exact=lambda: True, cache=False)  # fmt: skip
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events == [("cpu_plan", "info")]
    (entry,) = logs
    assert entry["screened_lm_head"].startswith("off: no bf16 dot products")
    assert entry["int8_lm_head"].startswith("on: 7-bit activations (no VNNI")


@pytest.mark.parametrize(
    ("screened", "int8"), [(False, True), (False, False), (True, False), (True, True)]
)
def test_every_screen_combination_keeps_greedy_exact(
    screened: bool,
    int8: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """The int8 screen also runs without the bf16 one (a VNNI CPU without bf16: Ice Lake)."""
    from asyncpaged.model.lm_head_int8 import int8_screen_supported

    runner = _runner(tiny_checkpoint("llama-gqa"), screened_lm_head=screened, int8_lm_head=int8)
    assert runner.bf16_screen == screened
    assert (runner.int8_head is not None) == (int8 and int8_screen_supported())
    seqs = _make_sequences(seed=14)
    Driver(runner, seed=2, want_logprob=False).run(seqs)
    _assert_matches(seqs, hf_reference("llama-gqa"))


def test_engine_reports_its_plan(tiny_checkpoint: Callable[[str], Path]) -> None:
    config = EngineConfig(model=str(tiny_checkpoint("llama-gqa")), dtype="float32",
                          packed_linears=False)  # fmt: skip

    async def main() -> None:
        async with AsyncEngine(config) as engine:
            plan = engine.cpu_plan
            assert plan is not None
            assert plan.packed_linears.enabled is False
            assert plan.packed_linears.reason == "off in EngineConfig"
            assert engine.runner.bf16_screen == plan.screened_lm_head.enabled
            with anyio.fail_after(30):
                params = SamplingParams(temperature=0.0, max_tokens=3)
                await engine.generate([5, 6, 7], params)

    anyio.run(main)


def test_engine_plans_a_bfloat16_model(tiny_checkpoint: Callable[[str], Path]) -> None:
    """The plan covers a bfloat16 model: its layers and head are packed where the plan says so
    (on where this CPU packs bfloat16 faster), the fused ops run where the library builds, and
    no screen runs."""
    from asyncpaged.model.packed_linear import PACKED_ATTR

    config = EngineConfig(model=str(tiny_checkpoint("llama-gqa")), dtype="bfloat16",
                          executor_backend="thread")  # fmt: skip

    async def main() -> None:
        async with AsyncEngine(config) as engine:
            plan = engine.cpu_plan
            assert plan is not None and plan.dtype == "bfloat16"
            runner = engine.runner
            packed = [PACKED_ATTR in m.__dict__ for name, m in runner.model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name != "lm_head"]  # fmt: skip
            assert packed and all(p == plan.packed_linears.enabled for p in packed)
            assert (runner.model.packed_lm_head is not None) == plan.packed_linears.enabled
            assert runner.screened_head is None and runner.int8_head is None
            assert (runner.model.fused_ops is not None) == plan.fused_elementwise.enabled
            with anyio.fail_after(30):
                params = SamplingParams(temperature=0.0, max_tokens=3)
                out = await engine.generate([5, 6, 7], params)
            assert len(out.outputs[0].token_ids) == 3

    anyio.run(main)


def test_packed_bfloat16_runner_gives_the_unpacked_tokens(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """A bfloat16 runner packed and unpacked over the same chunked, staggered sequences, on one
    thread (tests/model's): the same tokens and logprobs where this CPU's exactness check finds
    packing keeps F.linear's bits; where this torch cannot pack bf16, nothing is packed."""
    from asyncpaged.model.packed_linear import PACKED_ATTR, can_pack

    outputs = []
    for packed in (True, False):
        runner = _runner(tiny_checkpoint("llama-gqa"), dtype="bfloat16", packed_linears=packed)
        num_packed = sum(PACKED_ATTR in m.__dict__ for m in runner.model.modules())
        assert (num_packed > 0) == (packed and can_pack(torch.bfloat16))
        assert (runner.model.packed_lm_head is not None) == (num_packed > 0)
        seqs = _make_sequences(seed=6)
        Driver(runner, seed=3).run(seqs)
        outputs.append([(s.output, s.logprobs) for s in seqs])
    from asyncpaged.model.lever_checks import check_lever
    from asyncpaged.model.loader import linear_shapes

    exact = all(check_lever("packed_linear_bf16", {"rows": 64, "in": i, "out": o, "bias": b}).exact
                for i, o, b in linear_shapes(tiny_checkpoint("llama-gqa")))  # fmt: skip
    if can_pack(torch.bfloat16) and exact:
        assert outputs[0] == outputs[1]


def test_vector_flags_name_the_vector_units_only() -> None:
    intel = CpuFeatures("x86_64", "Xeon (AMX)", frozenset(
        {"fpu", "sse4_2", "avx2", "fma", "avx512f", "avx512_fp16", "avx512_bf16", "avx_vnni",
         "amx_bf16", "amx_tile", "hypervisor", "pdpe1gb"}))  # fmt: skip
    assert intel.vector_flags() == ("amx_bf16", "amx_tile", "avx2", "avx512_bf16",
                                    "avx512_fp16", "avx512f", "avx_vnni", "fma")  # fmt: skip
    arm = CpuFeatures("aarch64", "Neoverse", frozenset({"fp", "asimd", "sve", "bf16", "atomics"}))
    assert arm.vector_flags() == ("asimd", "bf16", "sve")


def test_an_inexact_lever_is_off_and_says_why() -> None:
    """Each lever's exactness check, not its CPU flags, decides whether it may run: an inexact
    one is off (never timed), the others unaffected."""
    probes = {"packed_linear": "packed_linears", "bf16_head": "screened_lm_head",
              "int8_head": "int8_lm_head", "fused": "fused_elementwise"}  # fmt: skip
    for probe, lever in probes.items():
        timer = Timings()
        plan = plan_cpu(AUTO, hidden_size=512, intermediate_size=1376, vocab_size=32000,
                        features=ZEN4, timer=timer, checker=Checks(probe),
                        int8_exact=lambda: True, library_target=lambda: "avx512",
                        cache=False)  # fmt: skip
        expected = {name: name != lever for name in LEVERS}
        assert plan.levers() == dict(expected, native_bf16_decode=False)  # a float32 model
        assert getattr(plan, lever).reason == f"not exact here: {probe} differs"
        assert probe not in timer.calls
    exact = plan_cpu(AUTO, hidden_size=512, intermediate_size=1376, vocab_size=32000,
                     features=ZEN4, timer=Timings(), checker=Checks(), int8_exact=lambda: True,
                     library_target=lambda: "avx512", cache=False)  # fmt: skip
    assert exact.packed_linears.reason.startswith(
        "bit-identical to F.linear at the model's 2 layer and head shapes, up to 2048 rows; "
        "packed 1000.00 ms"
    )
    assert exact.fused_elementwise.reason == "native kernels built for avx512; fused checked"


# qwen2: q/k/v projections with a bias; qwen3: a [64 -> 64] layer whose packed 1-row GEMM rounds
# otherwise than F.linear's on Zen 4 (its check turns packing off there), and whose F.linear
# itself rounds a row in a batch otherwise than alone (6 batches of 9 rows in 300 here), so its
# requests are compared one at a time, as transformers runs them
@pytest.mark.parametrize(("name", "concurrent"),
                         [("llama-gqa", True), ("qwen2", True), ("qwen3", False)])  # fmt: skip
def test_a_bfloat16_engine_with_the_default_plan_gives_transformers_bf16_tokens(
    name: str, concurrent: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """A bfloat16 model through the engine with every lever on "auto" (the plan this CPU's
    checks and timings give): greedy requests of several lengths, token-identical to
    transformers' own bfloat16 generate on this CPU."""
    path = tiny_checkpoint(name)
    reference = HFReference(path, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    lengths = (1, 3, 9, 15, 16, 17, 30, 33, 47)
    prompts = [tuple(torch.randint(3, 250, (n,), generator=gen).tolist()) for n in lengths]
    config = EngineConfig(model=str(path), dtype="bfloat16", executor_backend="thread")

    async def main() -> list[list[int]]:
        async with AsyncEngine(config) as engine:
            assert engine.cpu_plan is not None and engine.cpu_plan.dtype == "bfloat16"
            assert engine.cpu_plan.native_bf16_decode.enabled is False
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            outs: list[list[int]] = [[] for _ in prompts]

            async def one(i: int) -> None:
                out = await engine.generate(list(prompts[i]), params)
                outs[i] = list(out.outputs[0].token_ids)

            with anyio.fail_after(120):
                if concurrent:
                    async with anyio.create_task_group() as tg:
                        for i in range(len(prompts)):
                            tg.start_soon(one, i)
                else:
                    for i in range(len(prompts)):
                        await one(i)
            return outs

    got = anyio.run(main)
    assert got == [reference.generate(p, 24)[0] for p in prompts]
