"""Gemma 2 and Gemma 3 (text) through ModelRunner equal transformers, token for token.

The schedule is test_generate_equality's (staggered, chunked prompts across block boundaries,
NaN-poisoned cache, concurrent sequences); the tiny models have sliding windows shorter than the
prompts, GQA, head_dim x heads != hidden and query_pre_attn_scalar != head_dim; Gemma 2's
softcaps saturate (checked below), Gemma 3's local and global RoPE differ.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpaged.kernels.cpu_attention import CpuAttentionBackend
from asyncpaged.model.attention import AttentionBackend
from asyncpaged.model.errors import CheckpointError, UnsupportedModelError
from asyncpaged.model.gemma import GemmaForCausalLM
from asyncpaged.model.loader import load_model
from asyncpaged.testing.tiny_models import TINY_MODELS, build_tiny_model
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference
from tests.model.test_generate_equality import _assert_matches, _make_sequences, _runner

GEMMAS = ["gemma2", "gemma3"]
_LEVERS_OFF = {
    "packed_linears": False,
    "screened_lm_head": False,
    "int8_lm_head": False,
    "fused_elementwise": False,
}
#: bf16 vs bf16: both sides round every activation to 8 mantissa bits, in different orders
#: (paged, chunked attention and our float32 final softcap vs one-shot eager/SDPA and a bf16
#: softcap), so neither is the truth: transformers' own bf16 logprobs differ from its float32
#: ones by up to 0.17 (Gemma 2) and 0.28 (Gemma 3) on these rows (measured), ours from its bf16
#: ones by up to 0.17. A token-wise bound of 0.25 allows that; the mean bound (measured 0.03)
#: catches a systematic error (a missing cap or norm offset, wrong embedding rounding).
BF16_LOGPROB_TOL = 0.25
BF16_MEAN_TOL = 0.05


@pytest.mark.parametrize("levers", ["levers-default", "levers-off"])
@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
@pytest.mark.parametrize("name", GEMMAS)
def test_greedy_matches_transformers(
    name: str,
    backend: str,
    levers: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    attn: AttentionBackend | None = None
    if backend == "cpu-native":
        native = CpuAttentionBackend()
        assert native.is_native, "the native CPU attention kernel did not build"
        attn = native
    kwargs = _LEVERS_OFF if levers == "levers-off" else {}
    runner = _runner(tiny_checkpoint(name), backend=attn, **kwargs)
    seqs = _make_sequences(seed=1)
    Driver(runner, seed=7).run(seqs)
    _assert_matches(seqs, hf_reference(name))


def _count_screens(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    from asyncpaged.model import lm_head, lm_head_int8

    calls: Counter[str] = Counter()

    def spy(cls: Any, method: str) -> None:
        original = getattr(cls, method)

        def wrapped(self: Any, *args: Any) -> Any:
            calls[f"{cls.__name__}.{method}"] += 1
            return original(self, *args)

        monkeypatch.setattr(cls, method, wrapped)

    spy(lm_head.ScreenedLMHead, "argmax")
    spy(lm_head.ScreenedLMHead, "topk_candidates")
    spy(lm_head_int8.Int8ScreenedArgmax, "argmax")
    return calls


@pytest.mark.parametrize("name", GEMMAS)
def test_screened_head_only_without_final_softcap(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain greedy rows (no logprobs): Gemma 2 (softcapped logits) never builds or takes a
    screened head; Gemma 3 (no softcap) takes it. Both match transformers."""
    calls = _count_screens(monkeypatch)
    runner = _runner(tiny_checkpoint(name))
    softcapped = runner.model.final_logit_softcap is not None
    assert softcapped == (name == "gemma2")
    assert (runner.screened_head is None) == softcapped
    if softcapped:
        assert runner.int8_head is None
    seqs = _make_sequences(seed=4)
    Driver(runner, seed=5, want_logprob=False).run(seqs)
    assert (sum(calls.values()) == 0) == softcapped, calls
    _assert_matches(seqs, hf_reference(name))


def _hf_greedy(model: Any, prompt: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def _hf_logprobs(model: Any, prompts: list[tuple[int, ...]]) -> list[torch.Tensor]:
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            rows.append(torch.log_softmax(model(ids).logits[0].float(), dim=-1))  # [n, V]
    return rows


def test_gemma2_softcaps_change_transformers_output() -> None:
    """The tiny Gemma 2's softcaps are small enough to matter: without the attention cap,
    transformers' greedy tokens change; without the final cap (monotonic: the same argmax), its
    logprobs move far beyond LOGPROB_TOL. So a missing or misplaced cap cannot pass."""
    prompts = [tuple(s.prompt) for s in _make_sequences(seed=1)]
    model = build_tiny_model("gemma2")
    greedy = [_hf_greedy(model, p) for p in prompts]
    capped = _hf_logprobs(model, prompts)
    model.config.final_logit_softcapping = None
    uncapped = _hf_logprobs(model, prompts)
    assert min(float((a - b).abs().max()) for a, b in zip(capped, uncapped, strict=True)) > 0.1
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert [_hf_greedy(model, p) for p in prompts] != greedy


def test_gemma3_local_and_global_rope_differ(tiny_checkpoint: Callable[[str], Path]) -> None:
    model = load_model(tiny_checkpoint("gemma3"), "float32")
    assert isinstance(model, GemmaForCausalLM)
    local, full = model.rotary["sliding_attention"], model.rotary["full_attention"]
    assert (local.base, full.base, full.rope_type) == (10000.0, 1000.0, "linear")
    assert not torch.equal(local.inv_freq, full.inv_freq)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [12, None, 12, None]


def _bf16_deviations(seq: SimSequence, ref: Any) -> list[float]:
    """|our logprob - transformers' bf16 one| per token; asserts the token-wise bounds."""
    ids = torch.tensor([seq.prompt + tuple(seq.output)], dtype=torch.int64)
    with torch.no_grad():
        logits = ref(ids, attention_mask=torch.ones_like(ids)).logits[0]
    n = len(seq.prompt)
    rows = torch.log_softmax(logits[n - 1 : n - 1 + len(seq.output)].float(), dim=-1)  # [8, V]
    deviations: list[float] = []
    for t, (token, got) in enumerate(zip(seq.output, seq.logprobs, strict=True)):
        want = float(rows[t, token])
        assert abs(got - want) <= BF16_LOGPROB_TOL, (seq.seq_id, t, got, want)
        best = float(rows[t].max())
        assert best - want <= BF16_LOGPROB_TOL, (seq.seq_id, t, "not transformers' argmax")
        deviations.append(abs(got - want))
    return deviations


@pytest.mark.parametrize("name", GEMMAS)
def test_bfloat16_close_to_transformers_bfloat16(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Runner in bf16 vs transformers in bf16 teacher-forcing our continuation: each sampled
    token's logprob within BF16_LOGPROB_TOL (BF16_MEAN_TOL on average), each token
    transformers' argmax or that close."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(name)
    seqs = [dataclasses.replace(s, max_new_tokens=8) for s in _make_sequences(seed=3)]
    Driver(_runner(path, dtype="bfloat16"), seed=9).run(seqs)
    ref: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    ref.eval()
    deviations = [d for seq in seqs for d in _bf16_deviations(seq, ref)]
    assert sum(deviations) / len(deviations) <= BF16_MEAN_TOL


def _config(name: str, **overrides: Any) -> Any:
    import transformers

    cls_name, kwargs, _ = TINY_MODELS[name]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


@pytest.mark.parametrize(
    ("name", "overrides", "field"),
    [
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("gemma3", {"hidden_activation": "silu"}, "hidden_activation"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e3},
                }
            },
            "rope_type",
        ),
    ],
    ids=[
        "gemma2-act",
        "gemma3-act",
        "bidirectional",
        "gemma3-attn-softcap",
        "gemma2-rope",
        "gemma3-rope",
    ],  # fmt: skip,
)
def test_unsupported_fields_fail_at_build(name: str, overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedModelError, match=field):
        GemmaForCausalLM(_config(name, **overrides))


@pytest.mark.parametrize("backend", ["torch", "cpu-native"])
def test_gemma3_multimodal_checkpoint_runs_its_language_model(
    backend: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """A ``Gemma3ForConditionalGeneration`` checkpoint (gemma-3-4b-it's layout: the language
    model under ``language_model.``, a vision tower beside it) serves text prompts exactly as
    transformers' multimodal model does on text."""
    path = tiny_checkpoint("gemma3-multimodal")
    cpu = CpuAttentionBackend() if backend == "cpu-native" else None
    runner = _runner(path, backend=cpu)
    assert runner.model.config.model_type == "gemma3_text"
    assert not any("vision" in name for name, _ in runner.model.named_parameters())
    seqs = _make_sequences(seed=3)
    Driver(runner, seed=4).run(seqs)
    _assert_matches(seqs, hf_reference("gemma3-multimodal"))


def test_gemma3_multimodal_checkpoint_without_its_language_model_is_refused(
    tmp_path: Path,
) -> None:
    from transformers import Gemma3Config

    config = Gemma3Config(text_config=dict(TINY_MODELS["gemma3"][1]))
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(tmp_path)
