"""The model runner in a process of its own (``EngineConfig.executor_backend="process"``).

Greedy tokens equal transformers' under concurrency and memory pressure (both preemption modes:
swaps cross the pipe in order with the steps), seeded sampling equals the in-process runner's,
what the mode cannot take is refused before anything runs, and a runner process that dies
fails every waiter at once and is reaped. "auto" chooses it on a CPU with two or more cores.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

from asyncpaged import (
    AsyncEngine,
    BeamSearchParams,
    EngineConfig,
    EngineDeadError,
    InvalidRequestError,
    SamplingParams,
    SpeculativeConfig,
    StructuredOutputsParams,
)
from asyncpaged.config import EXECUTOR_BACKEND_ENV, executor_backend_for
from asyncpaged.worker.process import RunnerProcess, result_from_wire, result_to_wire
from asyncpaged.worker.protocol import SampledToken, StepResult
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.engine.test_speculative import Oracle
from tests.model.reference import HFReference
from tests.worker_death import Death, assert_died_well, kill_worker

MODEL = "llama-gqa"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_greedy_matches_transformers_under_memory_pressure(
    mode: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(24, seed=1)  # at most 40 + 10 tokens: 4 blocks of 16
    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=8, preemption_mode=mode,
                                  executor_backend="process") as engine:  # fmt: skip
            assert engine.runner is None  # no model in this process
            assert engine.config.async_scheduling is True  # "auto" plans ahead here
            assert isinstance(engine._executor.runner, RunnerProcess)
            child = engine._executor.runner.pid
            assert child is not None and child != os.getpid()
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], prompt
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs > 0 and stats.num_swap_ins > 0) == (mode == "swap")
    assert not Path(f"/proc/{child}").exists(), "the runner process was not reaped"


async def test_seeded_sampling_equals_the_in_process_runner(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(12, seed=5)

    def params(i: int) -> SamplingParams:  # seeded and not, penalties, logprobs, n > 1
        return SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=8, n=1 + i % 2,
                              seed=i if i % 3 else None, repetition_penalty=1.2,
                              logprobs=2, ignore_eos=True)  # fmt: skip

    results = {}
    for backend in ("thread", "process"):
        with anyio.fail_after(180):
            async with running_engine(path, num_device_blocks=64, seed=7,
                                      executor_backend=backend) as engine:  # fmt: skip
                outs = []
                for i in range(len(prompts)):  # one at a time: unseeded draws in a fixed order
                    outs.append(await engine.generate(list(prompts[i]), params(i)))
        results[backend] = [
            [(c.token_ids, [sorted(d.items()) for d in c.logprobs or []]) for c in o.outputs]
            for o in outs
        ]
    assert results["process"] == results["thread"]
    distinct = {tuple(tokens) for out in results["thread"] for tokens, _ in out}
    assert len(distinct) > len(prompts)  # not one degenerate sequence


async def test_grammars_beams_and_prompt_logprobs_equal_the_in_process_runner(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """What else crosses the pipe: grammar bitmasks in the rows' options, beam search's forks and
    logprobs, prompt logprobs in the result."""
    path = tiny_checkpoint(MODEL)
    prompts = [list(p) for p in make_prompts(4, seed=9)]
    schema = {"type": "object", "properties": {"n": {"enum": ["ann", "bob"]}}, "required": ["n"]}
    grammar = StructuredOutputsParams(json=schema)
    json_params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=grammar)
    plp_params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("thread", "process"):
        with anyio.fail_after(180):
            async with running_engine(path, num_device_blocks=64,
                                      executor_backend=backend) as engine:  # fmt: skip
                json_out = await generate_all(engine, [tuple(p) for p in prompts], json_params)
                plp_out = await engine.generate(prompts[0], plp_params)
                beam_out = [await engine.beam_search(p, beams) for p in prompts[:2]]
        results[backend] = (
            [o.outputs[0].text for o in json_out],
            [sorted(d.items()) if d else None for d in plp_out.prompt_logprobs or []],
            [[(c.token_ids, c.cumulative_logprob) for c in b.outputs] for b in beam_out],
        )
    assert results["process"] == results["thread"]
    texts, plp, _ = results["thread"]
    assert all(t.startswith("{") and '"n"' in t for t in texts), texts  # the grammar held
    assert len(plp) == len(prompts[0]) and plp[0] is None


async def test_speculative_rows_match_transformers(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Proposals (some wrong) verified in the runner's process: greedy tokens unchanged."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(8, seed=7)
    expected = {p: [ref.generate(p, 12)[0]] for p in prompts}
    monkeypatch.setattr(AsyncEngine, "_proposer", lambda self: Oracle(expected, seed=1))
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=64, speculative_config=spec,
                                  executor_backend="process") as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, greedy)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == expected[prompt][0], prompt
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_a_draft_model_loads_and_speculates_in_the_runners_process(
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    perturbed_draft: Callable[[str], Path],
) -> None:
    """The draft's cache is the process's too: it mirrors the target's slots, swaps and
    recomputes there, so greedy tokens stay transformers' while some proposals are rejected."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(12, seed=8)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=4,
                             model=str(perturbed_draft(MODEL)))  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with anyio.fail_after(240):
        async with running_engine(path, num_device_blocks=12, preemption_mode=mode,
                                  speculative_config=spec,
                                  executor_backend="process") as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, greedy)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 20)[0], prompt
    assert stats.num_preemptions > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_what_the_mode_cannot_take_is_refused_at_config(tmp_path: Path) -> None:
    base = EngineConfig(model=str(tmp_path), executor_backend="process")
    for change, what in [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=1"),
        ({"executor_backend": "processes"}, "'auto', 'thread' or 'process'"),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequestError, match=what):
            dataclasses.replace(base, **change)


async def test_logits_processors_are_refused_and_the_engine_goes_on(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)

    def nothing(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits

    prompt = make_prompts(1, seed=3)[0]
    with anyio.fail_after(120):
        async with running_engine(path, executor_backend="process") as engine:
            with pytest.raises(InvalidRequestError, match="logits_processors"):
                engine.generate(list(prompt), SamplingParams(logits_processors=[nothing]))
            out = await engine.generate(list(prompt), GREEDY)
    assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0]


def test_a_script_without_the_main_guard_runs_its_top_level_once(
    tmp_path: Path, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """The runner's process is a fresh interpreter that imports only asyncpaged: a script
    without ``if __name__ == "__main__":`` works, and its top level runs once (a
    ``multiprocessing`` spawn would import it again in the child)."""
    script = tmp_path / "no_guard.py"
    runs = tmp_path / "runs.txt"
    script.write_text(
        "import anyio, os\n"
        "from asyncpaged import AsyncEngine, EngineConfig, SamplingParams\n"
        f"with open({str(runs)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "async def main():\n"
        f"    async with AsyncEngine(EngineConfig(model={str(tiny_checkpoint(MODEL))!r},\n"
        "                                        executor_backend='process')) as engine:\n"
        "        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3))\n"
        "        print(len(out.outputs[0].token_ids), engine.runner is None)\n"
        "anyio.run(main)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "True"]
    assert len(runs.read_text().split()) == 1


def test_auto_chooses_the_process_on_a_cpu_with_two_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What "auto" resolves to, and why, for each case it tells apart (the test suite's
    conftest sets the environment variable to "thread": it is taken out here)."""
    monkeypatch.delenv(EXECUTOR_BACKEND_ENV, raising=False)
    base = EngineConfig(model=str(tmp_path))
    assert base.executor_backend == "auto"  # the default
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert executor_backend_for(base)[0] == "process"
    # the KV tiers' store goes into the runner's process (tests/engine/test_kv_tiers.py)
    tiers = dataclasses.replace(base, kv_offload_host_bytes=1 << 20, enable_prefix_caching=True)
    assert executor_backend_for(tiers)[0] == "process"
    # CUDA too: on an H100's host the process with async scheduling took 2.6 ms per step of
    # `bench overhead` against the thread's 4.1-4.3 (docs/benchmarks.md)
    assert executor_backend_for(dataclasses.replace(base, device="cuda:1"))[0] == "process"
    for change, why in [
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"device": "mps"}, "not measured"),
        ({"executor_backend": "thread"}, "configured"),
    ]:  # fmt: skip
        backend, reason = executor_backend_for(dataclasses.replace(base, **change))
        assert backend == "thread" and why in reason, (change, reason)
    assert executor_backend_for(dataclasses.replace(base, executor_backend="process")) == (
        "process",
        "configured",
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    backend, reason = executor_backend_for(base)
    assert backend == "thread" and "one usable core" in reason
    monkeypatch.setenv(EXECUTOR_BACKEND_ENV, "process")
    assert executor_backend_for(base) == ("process", EXECUTOR_BACKEND_ENV)
    monkeypatch.setenv(EXECUTOR_BACKEND_ENV, "thread")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert executor_backend_for(base) == ("thread", EXECUTOR_BACKEND_ENV)
    monkeypatch.setenv(EXECUTOR_BACKEND_ENV, "threads")
    with pytest.raises(InvalidRequestError, match=EXECUTOR_BACKEND_ENV):
        executor_backend_for(base)


async def test_auto_runs_the_runner_in_its_process(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """With "auto" and no environment variable, an engine on this CPU (2+ cores) runs its
    runner in a process, says so in ``engine.config``, and its greedy tokens equal
    transformers'."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one usable core: 'auto' rightly chooses the thread here")
    monkeypatch.delenv(EXECUTOR_BACKEND_ENV, raising=False)
    path = tiny_checkpoint(MODEL)
    prompt = make_prompts(1, seed=3)[0]
    ref = HFReference(path)
    config = EngineConfig(model=str(path), dtype="float32", executor_backend="auto")
    async with AsyncEngine(config) as engine:
        assert engine.config.executor_backend == "process" and engine.runner is None
        out = await engine.generate(list(prompt), GREEDY)
    assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0]


def _children() -> set[int]:
    """This process's live children (from /proc)."""
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                kids.add(int(entry))
    return kids


async def test_failed_starts_leave_no_process(
    tmp_path: Path, tiny_checkpoint: Callable[[str], Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """The process is launched before the checkpoint is read: a start that fails here (no
    weights: the plan is made, the process's load fails and says why) or before the process
    was told what to load (no config) stops it."""
    before = _children()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((tiny_checkpoint(MODEL) / name).read_bytes())
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    for path, error in [(no_weights, "no weights"), (no_config, "no config.json")]:
        with pytest.raises(Exception, match=error):
            async with AsyncEngine(EngineConfig(model=str(path), executor_backend="process")):
                pass
        assert _children() == before, path
    # a process told to stop before it loaded anything leaves quietly
    assert "cannot unpack" not in capfd.readouterr().err


@pytest.mark.parametrize("when", ["mid_run", "idle"])
async def test_killed_runner_process_fails_every_waiter(
    when: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    prompts = make_prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    cfg = EngineConfig(model=str(tiny_checkpoint(MODEL)), dtype="float32",
                       executor_backend="process", num_device_blocks=128)  # fmt: skip
    pids: list[int] = []
    deaths: list[Death] = []
    with pytest.raises(EngineDeadError) as exit_info, anyio.fail_after(120):  # no hang
        async with AsyncEngine(cfg) as engine:
            proc = engine._executor.runner
            assert isinstance(proc, RunnerProcess) and proc.pid is not None
            pids.append(proc.pid)
            deaths.append(await kill_worker(engine, proc.pid, when, prompts, params,
                                            wait_idle=True))  # fmt: skip
    assert_died_well(exit_info.value, pids[0], when, deaths[0], len(prompts))


def test_a_step_result_crosses_the_pipe_whole() -> None:
    """Every field of a step's result survives the wire: ``cuda_graph`` too, which the
    engine's ``num_cuda_graph_steps`` counts (an H100 run of ``bench overhead`` with the
    process backend reported 0 replays while the child replayed its graphs)."""
    rows = (
        SampledToken(seq_id=3, token_id=17, logprob=-0.5, rank=1, top_logprobs=((17, -0.5),)),
        SampledToken(seq_id=4, token_id=2, logprob=None, accepted=(5, 6), proposals=(7,)),
    )
    for graphed in (False, True):
        result = StepResult(sampled=rows, compute_s=0.25, cuda_graph=graphed)
        wire = pickle.loads(pickle.dumps(result_to_wire(result)))
        back = result_from_wire(wire)
        assert back == result
        assert all(type(row) is SampledToken for row in back.sampled)
