"""Greedy generation through ModelRunner equals transformers' generate, token for token.

Every test runs a realistic schedule: staggered starts (prefill and decode of different sequences
in one step), prompts split into chunks across steps, scattered physical blocks reused dirty, a
NaN-poisoned cache, and compares each sequence with transformers run on that prompt alone.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncpaged.kernels import cpu_build
from asyncpaged.model.attention import AttentionBackend
from asyncpaged.model.base import FusedElementwise
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.testing.tiny_models import VOCAB_SIZE
from asyncpaged.worker.protocol import SequenceStep, StepPlan
from asyncpaged.worker.runner import ModelRunner
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference

BF16_NORM_LOGPROB_TOL = 1e-2
FAMILIES = ["llama-gqa", "llama-mha", "mistral", "qwen2", "opt", "opt-post-ln", "gpt2"]
ROPE_VARIANTS = ["llama-rope-linear", "llama-rope-dynamic", "llama-rope-llama3", "llama-rope-yarn"]
PROMPT_LENS = (15, 16, 17, 1, 5, 31, 32, 33, 9, 40)
MAX_NEW = 12
LOGPROB_TOL = 1e-4


def _prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(4, VOCAB_SIZE) for _ in range(length))


def _chunks(length: int, parts: int) -> tuple[int, ...]:
    cut = sorted(random.Random(length).sample(range(1, length), parts - 1))
    bounds = [0, *cut, length]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def _make_sequences(seed: int, *, chunked: bool = True) -> list[SimSequence]:
    rng = random.Random(seed)
    seqs = []
    for i, length in enumerate(PROMPT_LENS):
        parts = (i % 3) + 1 if chunked and length >= 3 else 1  # 1, 2 or 3 chunks
        seqs.append(
            SimSequence(
                seq_id=100 + i,
                prompt=_prompt(rng, length),
                max_new_tokens=MAX_NEW,
                start_step=(i * 3) % 7,  # staggered: prefills land among other sequences' decodes
                chunk_sizes=_chunks(length, parts) if parts > 1 else (),
            )
        )
    return seqs


def _runner(
    path: Path,
    num_blocks: int = 64,
    *,
    dtype: str = "float32",
    backend: AttentionBackend | None = None,
    **levers: bool,
) -> ModelRunner:
    """A runner over a NaN-poisoned cache of 16-token blocks (the levers at their defaults
    unless given; ``backend`` None: the torch attention path)."""
    return ModelRunner(
        path,
        dtype,
        num_blocks=num_blocks,
        block_size=16,
        num_host_blocks=16,
        kv_fill_value=float("nan"),
        attn_backend=backend,
        **levers,
    )


def _assert_matches(seqs: list[SimSequence], ref: HFReference) -> None:
    for seq in seqs:
        tokens, logprobs = ref.generate(seq.prompt, seq.max_new_tokens)
        assert seq.output == tokens, f"seq {seq.seq_id} (prompt len {len(seq.prompt)}) diverged"
        if seq.logprobs:
            for got, want in zip(seq.logprobs, logprobs, strict=True):
                assert abs(got - want) <= LOGPROB_TOL, (seq.seq_id, got, want)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain-linear"])
@pytest.mark.parametrize(
    "screen", ["int8", "bf16", None], ids=["int8-screened-head", "bf16-screened-head", "full-head"]
)
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha", "opt", "gpt2"])
def test_cpu_levers_keep_greedy_equal_to_transformers(
    name: str,
    packed: bool,
    screen: str | None,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain greedy rows (no logprobs) take the screened head (int8 or bf16); each lever on and
    off."""
    from asyncpaged.model import lm_head, lm_head_int8, packed_linear

    screens: Counter[str] = Counter()
    bf16_argmax = lm_head.ScreenedLMHead.argmax
    int8_argmax = lm_head_int8.Int8ScreenedArgmax.argmax

    def bf16_spy(
        self: lm_head.ScreenedLMHead, hidden: torch.Tensor, mask_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        screens["bf16"] += 1
        return bf16_argmax(self, hidden, mask_bias)

    def int8_spy(
        self: lm_head_int8.Int8ScreenedArgmax,
        hidden: torch.Tensor,
        mask_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = int8_argmax(self, hidden, mask_bias)
        assert tokens is not None, "the int8 screen gave up on finite hidden states"
        screens["int8"] += 1
        return tokens

    monkeypatch.setattr(lm_head.ScreenedLMHead, "argmax", bf16_spy)
    monkeypatch.setattr(lm_head_int8.Int8ScreenedArgmax, "argmax", int8_spy)
    runner = _runner(
        tiny_checkpoint(name),
        packed_linears=packed,
        screened_lm_head=screen is not None,
        int8_lm_head=screen == "int8",
    )
    num_packed = sum(packed_linear.PACKED_ATTR in m.__dict__ for m in runner.model.modules())
    assert (num_packed > 0) == (packed and packed_linear.packing_supported())
    # Without the bf16 screen the full head runs every step: packed like the layers.
    packed_head = runner.model.packed_lm_head is not None
    assert packed_head == (packed and screen is None and packed_linear.packing_supported())
    seqs = _make_sequences(seed=4)
    Driver(runner, seed=5, want_logprob=False).run(seqs)
    used = screen if screen != "int8" or lm_head_int8.int8_screen_supported() else "bf16"
    assert set(screens) == ({used} if used else set())
    _assert_matches(seqs, hf_reference(name))


class _CountingOps:
    """Wraps the model's fused ops and counts the calls of each."""

    def __init__(self, ops: FusedElementwise) -> None:
        self.ops = ops
        self.calls: Counter[str] = Counter()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls["rms_norm"] += 1
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        self.calls["add_rms_norm"] += 1
        return self.ops.add_rms_norm(residual, x, weight, eps)

    def rotary_(
        self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        self.calls["rotary_"] += 1
        self.ops.rotary_(q, k, cos, sin)

    def silu_mul(
        self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.calls["silu_mul"] += 1
        return self.ops.silu_mul(gate, up, out)


def _fused_calls(runner: ModelRunner, steps: int, *, silu_mul: bool) -> dict[str, int]:
    """The fused ops' calls in ``steps`` steps of a Llama-family model: each op once per use."""
    layers = runner.model.num_layers
    calls = {"rms_norm": steps, "add_rms_norm": 2 * layers * steps, "rotary_": layers * steps}
    return {**calls, "silu_mul": layers * steps} if silu_mul else calls


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-elementwise"])
@pytest.mark.parametrize("name", ["llama-gqa", "mistral", "qwen2", "llama-rope-yarn"])
def test_fused_elementwise_keeps_greedy_equal_to_transformers(
    name: str,
    fused: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """The fused norm / RoPE / SiLU ops (Llama family) on and off: the same tokens and logprobs
    as transformers; on, every op runs once per use in every step (when the library builds)."""
    runner = _runner(tiny_checkpoint(name), fused_elementwise=fused)
    counting = None
    if runner.model.fused_ops is not None:
        counting = _CountingOps(runner.model.fused_ops)
        runner.model.fused_ops = counting
    assert (counting is not None) == (fused and cpu_build.find_compiler() is not None)
    seqs = _make_sequences(seed=6)
    driver = Driver(runner, seed=8)
    driver.run(seqs)
    _assert_matches(seqs, hf_reference(name))
    if counting is not None:
        assert counting.calls == _fused_calls(runner, driver.step_index, silu_mul=True)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "qwen3-moe", "phi3-longrope"])
def test_fused_elementwise_in_bfloat16_gives_the_torch_paths_tokens(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """A bfloat16 model with the fused norms and RoPE (SiLU x up stays torch's in bf16) and
    without: the same tokens over chunked, staggered sequences, since the kernels round to bf16
    where the torch code does (tests/kernels/test_cpu_fused.py checks the bits). The logprobs
    agree to BF16_NORM_LOGPROB_TOL: the norm's sum of squares runs in another order, and where
    that fp32 ulp crosses a bf16 rounding boundary one normalised value moves one bf16 ulp
    (measured: phi3-longrope, one logprob in 1e-3)."""
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found: no fused ops")
    outputs = []
    for fused in (True, False):
        runner = _runner(tiny_checkpoint(name), dtype="bfloat16", fused_elementwise=fused)
        assert (runner.model.fused_ops is not None) == fused
        counting = None
        if fused:
            counting = runner.model.fused_ops = _CountingOps(runner.model.fused_ops)
        seqs = _make_sequences(seed=6)
        driver = Driver(runner, seed=8)
        driver.run(seqs)
        outputs.append([(s.output, s.logprobs) for s in seqs])
        if counting is not None:
            assert counting.calls == _fused_calls(runner, driver.step_index, silu_mul=False)
    for (fused_tokens, fused_logprobs), (tokens, logprobs) in zip(*outputs, strict=True):
        assert fused_tokens == tokens
        for got, want in zip(fused_logprobs, logprobs, strict=True):
            assert abs(got - want) <= BF16_NORM_LOGPROB_TOL, (got, want)


def test_bfloat16_greedy_rows_take_the_native_argmax(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """A bfloat16 runner's plain greedy rows take the native argmax of the head's bf16 logits
    (CausalLM.head_argmax) in every step, and give the tokens of the float32 logits' argmax
    (native_argmax off)."""
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found: no native argmax")
    outputs, calls = [], []
    for native in (True, False):
        runner = _runner(tiny_checkpoint("llama-gqa"), dtype="bfloat16")
        argmax = runner.model.native_argmax
        assert argmax is not None
        count = [0]

        def counting(
            logits: torch.Tensor,
            argmax: Callable[[torch.Tensor], torch.Tensor] = argmax,
            count: list[int] = count,
        ) -> torch.Tensor:
            count[0] += 1
            assert logits.dtype == torch.bfloat16
            return argmax(logits)

        runner.model.native_argmax = counting if native else None
        seqs = _make_sequences(seed=6)
        driver = Driver(runner, seed=8, want_logprob=False)
        driver.run(seqs)
        outputs.append([s.output for s in seqs])
        calls.append((count[0], driver.step_index))
    assert outputs[0] == outputs[1]
    assert calls[0][0] == calls[0][1] > 0 and calls[1][0] == 0


@pytest.mark.parametrize(
    ("name", "lengths"),
    [("llama-gqa", (5, 16, 37, 60)), ("qwen3", (5, 16, 37, 60)), ("qwen2", (9, 33)),
     ("phi3-longrope", (5, 16, 37, 60)), ("mistral", (5, 12))],  # mistral: a 12-token window
)  # fmt: skip
def test_bfloat16_prompt_logits_equal_transformers_bits(
    name: str, lengths: tuple[int, ...], tiny_checkpoint: Callable[[str], Path]
) -> None:
    """A bfloat16 prompt's last-row logits equal transformers' bf16 forward bit for bit: packed
    linears (F.linear's bits on one thread), the CPU attention backend with whole prompts on
    torch's bf16 SDPA (transformers' call), the native argmax's logits. Fused norms off: their
    sum order may move one bf16 ulp (tests/kernels/test_cpu_fused.py). A prompt longer than a
    sliding window stays on the kernel's fp32 math (not claimed here)."""
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found: no CPU attention backend")
    from transformers import AutoModelForCausalLM

    from asyncpaged.kernels.cpu_attention import CpuAttentionBackend
    from asyncpaged.model.attention import AttentionMetadata

    path = tiny_checkpoint(name)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    runner = _runner(path, dtype="bfloat16", backend=CpuAttentionBackend(),
                     fused_elementwise=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        prompt = torch.randint(4, VOCAB_SIZE, (length,), generator=gen)
        md = AttentionMetadata.build(
            query_lens=[length], context_lens=[length], block_tables=[list(range(4))],
            slot_mapping=list(range(length)), device=torch.device("cpu"),
        )  # fmt: skip
        with torch.inference_mode():
            want = hf(prompt[None]).logits[0, -1]
            hidden = runner.model(prompt, torch.arange(length), md, runner.kv_cache)
            got = runner.model.head_logits(hidden[-1:])[0]
        assert got.dtype == want.dtype == torch.bfloat16
        assert torch.equal(got, want), (name, length)


def _slots(block: int, num_tokens: int) -> tuple[int, ...]:
    return tuple(range(16 * block, 16 * block + num_tokens))


def test_bfloat16_greedy_verification_takes_the_native_argmax(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Plain greedy proposals of a bfloat16 model are verified on the native argmax of the
    target's bf16 logits (one call over every sequence's num_draft + 1 rows): the same verdicts
    as the float32 logits' argmax."""
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found: no native argmax")
    prompts = [(5, 9, 33, 2, 17, 8, 5, 9, 33), (40, 41, 42, 43, 40, 41)]
    drafts = [(2, 17, 8), (42, 43)]
    verdicts, rows = [], []
    for native in (True, False):
        runner = _runner(tiny_checkpoint("llama-gqa"), dtype="bfloat16")
        argmax = runner.model.native_argmax
        assert argmax is not None
        seen: list[int] = []

        def counting(
            logits: torch.Tensor,
            argmax: Callable[[torch.Tensor], torch.Tensor] = argmax,
            seen: list[int] = seen,
        ) -> torch.Tensor:
            seen.append(logits.shape[0])
            return argmax(logits)

        runner.model.native_argmax = counting if native else None
        seqs = tuple(
            SequenceStep(i, p + d, 0, _slots(i, len(p + d)), (i,), True, num_draft=len(d))
            for i, (p, d) in enumerate(zip(prompts, drafts, strict=True))
        )
        result = runner.execute(StepPlan(seqs=seqs))
        verdicts.append([(t.seq_id, t.token_id, t.accepted) for t in result.sampled])
        rows.append(seen)
    assert verdicts[0] == verdicts[1]
    assert rows == [[sum(len(d) + 1 for d in drafts)], []]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    seqs = _make_sequences(seed=1)
    driver = Driver(_runner(tiny_checkpoint(name)), seed=7)
    mixed_steps = 0
    while not all(s.is_finished for s in seqs):
        active = [s for s in seqs if s.start_step <= driver.step_index and not s.is_finished]
        prefilling = sum(s.num_computed < len(s.prompt) for s in active)
        mixed_steps += 0 < prefilling < len(active)
        driver.step(seqs)
    assert mixed_steps > 0, "the schedule never mixed prefill and decode in one step"
    _assert_matches(seqs, hf_reference(name))


@pytest.mark.parametrize("name", ROPE_VARIANTS)
def test_rope_scaling_matches_transformers(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    # transformers' dynamic NTK rescales by the length of each forward call: a prompt split into
    # chunks would legitimately differ from its one-shot prefill, so dynamic runs unchunked.
    seqs = _make_sequences(seed=2, chunked=name != "llama-rope-dynamic")
    Driver(_runner(tiny_checkpoint(name)), seed=3).run(seqs)
    _assert_matches(seqs, hf_reference(name))


@pytest.mark.parametrize("name", ["llama-gqa", "opt"])
def test_fork_with_copy_on_write_matches_transformers(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    # Prompt of 20 tokens: block 1 is partially filled and shared after the fork, so the first
    # decode of either sequence must copy it (copy-on-write) before writing.
    parent = SimSequence(seq_id=1, prompt=_prompt(random.Random(5), 20), max_new_tokens=MAX_NEW)
    other = SimSequence(seq_id=2, prompt=_prompt(random.Random(6), 17), max_new_tokens=MAX_NEW)
    driver = Driver(_runner(tiny_checkpoint(name)), seed=11)
    driver.step([parent, other])  # both prefills
    child = driver.fork(parent, seq_id=3)
    seqs = [parent, child, other]
    driver.step(seqs)
    assert child.blocks[1] != parent.blocks[1], "copy-on-write did not give the child a new block"
    driver.run(seqs)
    _assert_matches(seqs, hf_reference(name))
    assert child.output == parent.output


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_swap_out_and_in_mid_generation_matches_transformers(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    seqs = _make_sequences(seed=4)[:4]
    driver = Driver(_runner(tiny_checkpoint(name)), seed=13)
    for _ in range(8):
        driver.step(seqs)
    victim = seqs[1]
    assert victim.output
    assert not victim.is_finished
    old_blocks = list(victim.blocks)
    driver.swap_out(victim)
    for _ in range(3):  # others run (and reuse the freed blocks) while it is out
        driver.step(seqs)
    driver.swap_in(victim)
    assert victim.blocks != old_blocks
    driver.run(seqs)
    _assert_matches(seqs, hf_reference(name))


def _check_logprobs_against_forward(seq: SimSequence, ref: HFReference) -> None:
    """Sampled-token logprob, rank and top-n vs transformers' log-softmax, teacher-forced."""
    expected = ref.score(seq.prompt, tuple(seq.output))  # [n, V]
    num_top = seq.sampling.num_logprobs if seq.sampling is not None else None
    for t, sampled in enumerate(seq.sampled):
        row = expected[t]
        want = float(row[sampled.token_id])
        assert sampled.logprob is not None
        assert abs(sampled.logprob - want) <= LOGPROB_TOL, (seq.seq_id, t)
        assert sampled.rank == int((row >= want).sum()), (seq.seq_id, t)
        top = torch.topk(row, num_top or 0)
        assert [i for i, _ in sampled.top_logprobs] == top.indices.tolist(), (seq.seq_id, t)
        for (_, got), value in zip(sampled.top_logprobs, top.values.tolist(), strict=True):
            assert abs(got - value) <= LOGPROB_TOL


def test_sampled_logprobs_ranks_and_top_logprobs_match_transformers(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    seqs = _make_sequences(seed=6)[:5]
    options = [
        SamplingOptions(temperature=0.0, num_logprobs=4),
        SamplingOptions(temperature=1.0, num_logprobs=5),
        SamplingOptions(temperature=0.7, top_p=0.9, seed=3, num_logprobs=0),
        SamplingOptions(temperature=1.3, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingOptions(top_k=5, frequency_penalty=0.4, seed=11, num_logprobs=2),
    ]
    for seq, opts in zip(seqs, options, strict=True):
        seq.sampling = opts
    Driver(_runner(tiny_checkpoint("llama-gqa")), seed=17).run(seqs)
    ref = hf_reference("llama-gqa")
    assert seqs[0].output == ref.generate(seqs[0].prompt, seqs[0].max_new_tokens)[0]
    assert any(s.rank != 1 for seq in seqs[1:] for s in seq.sampled), "nothing but argmaxes"
    for seq in seqs:
        _check_logprobs_against_forward(seq, ref)


def test_seeded_sampling_is_independent_of_batch_and_swap(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    def seeded(seed: int) -> SimSequence:
        return SimSequence(
            seq_id=1,
            prompt=_prompt(random.Random(8), 19),
            max_new_tokens=MAX_NEW,
            sampling=SamplingOptions(temperature=1.2, top_p=0.95, frequency_penalty=0.3, seed=seed),
        )

    runner = _runner(tiny_checkpoint("llama-gqa"))
    alone = seeded(42)
    Driver(runner, seed=1).run([alone])
    other_seed = seeded(43)
    Driver(runner, seed=1).run([other_seed])
    assert other_seed.output != alone.output

    batched = seeded(42)
    others = _make_sequences(seed=9)[:5]
    for i, seq in enumerate(others):
        seq.sampling = SamplingOptions(temperature=1.0, seed=i if i % 2 else None)
    everyone = [others[0], others[1], batched, *others[2:]]
    driver = Driver(runner, seed=5)
    for _ in range(6):
        driver.step(everyone)
    assert 0 < len(batched.output) < MAX_NEW
    driver.swap_out(batched)
    for _ in range(2):
        driver.step(everyone)
    driver.swap_in(batched)
    driver.run(everyone)
    assert batched.output == alone.output
