"""Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4-mini) against transformers, and its RoPE additions.

Greedy runs use test_generate_equality's schedule (staggered starts, chunked prompts, scattered
dirty blocks, a NaN-poisoned cache) through the torch and the native CPU attention backends.

longrope: transformers picks the short or long factors per forward call (``max(position_ids) + 1``
against ``original_max_position_embeddings``, 20 here) and Phi-3's ``generate`` recomputes the
whole cache once a sequence crosses it; we pick per token from the sequence's length after the
step (``rotary`` module docstring). The two agree for a sequence that stays at or below 20 tokens
all its life (chunked prompts included) and for a prompt above 20 prefilled in one step (chunked,
its first chunks would rotate with the short set, as transformers fed those chunks would). The
crossing sequences are checked against transformers' forward fed one token at a time with a cache,
which is the per-token rule.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpaged.kernels import cpu_build
from asyncpaged.kernels.cpu_attention import CpuAttentionBackend
from asyncpaged.model.base import TensorShard
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.model.phi3 import Phi3ForCausalLM
from asyncpaged.model.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from asyncpaged.testing.tiny_models import TINY_MODELS
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference
from tests.model.test_generate_equality import (
    LOGPROB_TOL,
    MAX_NEW,
    _assert_matches,
    _make_sequences,
    _runner,
)

NAMES = ["phi3-swa", "phi3-longrope", "phi4-mini"]
LONGROPE = ("phi3-longrope", "phi4-mini")
ORIGINAL_MAX = 20  # the longrope tiny models' original_max_position_embeddings
#: bf16 vs bf16: both sides' logits are bf16 GEMM outputs rounded to bf16 (ulp 2^-5 for |logit| in
#: [4, 8), where these models' logits lie); hidden states that differ by summation order and by
#: paged, incremental vs one-shot shapes move a logit by about one ulp, and the log-softmax
#: normaliser by about as much again. Measured worst: 2 ulps (0.058); allowed: 3 ulps of the
#: row's largest |logit|. (0.05 flat would be under 2 ulps, too tight.)
BF16_ULPS = 3


def _config(name: str) -> Any:
    import transformers

    config_cls, kwargs, _ = TINY_MODELS[name]
    return getattr(transformers, config_cls)(**copy.deepcopy(kwargs))  # configs edit their dicts


def _stays_below(seq: SimSequence) -> bool:
    """Every forward of the sequence (its last one sees prompt + MAX_NEW - 1 tokens) is short."""
    return len(seq.prompt) + seq.max_new_tokens - 1 <= ORIGINAL_MAX


def _sequences(name: str, seed: int) -> list[SimSequence]:
    """_make_sequences (chunked); for longrope, those on one side of ORIGINAL_MAX all their life,
    the ones above it prefilled in one step."""
    seqs = _make_sequences(seed)
    if name not in LONGROPE:
        return seqs
    kept = [s for s in seqs if _stays_below(s) or len(s.prompt) > ORIGINAL_MAX]
    for seq in kept:
        if len(seq.prompt) > ORIGINAL_MAX:
            seq.chunk_sizes = ()
    assert any(_stays_below(s) and s.chunk_sizes for s in kept)
    assert any(len(s.prompt) > ORIGINAL_MAX for s in kept)
    return kept


@pytest.mark.parametrize(
    ("backend", "levers"),
    [("torch", "default"), ("cpu", "default"), ("cpu", "off")],
    ids=["torch", "cpu-native", "cpu-native-levers-off"],
)
@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(
    name: str,
    backend: str,
    levers: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Tokens and logprobs equal transformers'; the native-backend run with default levers asks
    no logprobs, so its greedy rows take the screened LM head (tokens compared only)."""
    attn = CpuAttentionBackend() if backend == "cpu" else None
    if attn is not None:
        assert attn.is_native
    on = levers == "default"  # the four exact CPU levers, all True by default
    runner = _runner(
        tiny_checkpoint(name),
        backend=attn,
        packed_linears=on,
        screened_lm_head=on,
        int8_lm_head=on,
        fused_elementwise=on,
    )
    assert isinstance(runner.model, Phi3ForCausalLM)
    assert (runner.model.fused_ops is not None) == (on and cpu_build.find_compiler() is not None)
    seqs = _sequences(name, seed=1)
    want_logprob = not (backend == "cpu" and levers == "default")
    Driver(runner, seed=7, want_logprob=want_logprob).run(seqs)
    _assert_matches(seqs, hf_reference(name))


def _stepwise_transformers(path: Path, prompts: list[tuple[int, ...]]) -> list[list[torch.Tensor]]:
    """Greedy log-softmax rows [MAX_NEW] per prompt from transformers' forward fed the prompt,
    then one token per call with a cache (no recompute at the longrope switch)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        cache, ids, logprobs = DynamicCache(config=model.config), torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(MAX_NEW):
                logits = model(ids, cache=cache, use_cache=True).logits[0, -1]  # [V]
                logprobs.append(torch.log_softmax(logits.float(), dim=-1))
                ids = logprobs[-1].argmax().view(1, 1)
        out.append(logprobs)
    return out


@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_crossing_matches_per_token_transformers(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Sequences whose prompt is below 20 tokens and whose generation goes past it."""
    seqs = [s for s in _make_sequences(seed=1, chunked=False) if not _stays_below(s)]
    seqs = [s for s in seqs if len(s.prompt) <= ORIGINAL_MAX]
    assert len(seqs) >= 2
    Driver(_runner(tiny_checkpoint(name)), seed=7).run(seqs)
    expected = _stepwise_transformers(tiny_checkpoint(name), [s.prompt for s in seqs])
    for seq, rows in zip(seqs, expected, strict=True):
        assert seq.output == [int(row.argmax()) for row in rows], seq.seq_id
        for got, row, tok in zip(seq.logprobs, rows, seq.output, strict=True):
            assert abs(got - float(row[tok])) <= LOGPROB_TOL, (seq.seq_id, got, float(row[tok]))


def _bf16_tolerance(logits: torch.Tensor) -> float:
    """3 bf16 ulps of the row's largest |logit| (BF16_ULPS)."""
    exponent = math.floor(math.log2(float(logits.abs().max())))
    return BF16_ULPS * 2.0 ** (exponent - 7)  # bf16: 8 significant bits


@pytest.mark.parametrize("name", ["phi3-swa", "phi4-mini"])
def test_bfloat16_is_close_to_transformers_bfloat16(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Our bf16 greedy continuation (8 tokens), teacher-forced through transformers in bf16: each
    logprob within the tolerance of transformers', each token its argmax or within it."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(name)
    seqs = _sequences(name, seed=3)
    for seq in seqs:
        seq.max_new_tokens = 8
    runner = _runner(path, dtype="bfloat16")
    assert runner.model.lm_head_weight().dtype == torch.bfloat16
    Driver(runner, seed=2).run(seqs)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    for seq in seqs:
        ids = torch.tensor([seq.prompt + tuple(seq.output)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(seq.prompt) - 1 : -1].float()  # [8, V]
        rows = torch.log_softmax(logits, dim=-1)
        for got, row, tok, raw in zip(seq.logprobs, rows, seq.output, logits, strict=True):
            tol = _bf16_tolerance(raw)
            assert abs(got - float(row[tok])) <= tol, (seq.seq_id, got, float(row[tok]), tol)
            assert float(row[tok]) >= float(row.max()) - tol, (seq.seq_id, tok)


def test_partial_rotary_passes_the_tail_through_bit_identical() -> None:
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = _config("phi4-mini")
    rotary = RotaryEmbedding(
        config, 16, torch.device("cpu"), allow_partial=True, allow_longrope=True
    )
    assert rotary.rotary_dim == 12
    positions = torch.arange(7, dtype=torch.int64) * 5
    cos, sin = rotary.cos_sin(positions, positions + 1, torch.float32)  # [7, 12]
    q, k = torch.randn(7, 4, 16), torch.randn(7, 1, 16)
    q_rot, k_rot = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert torch.equal(q_rot[..., 12:], q[..., 12:])
    assert torch.equal(k_rot[..., 12:], k[..., 12:])
    assert not torch.equal(q_rot[1:, :, :12], q[1:, :, :12])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)  # broadcasts over our [T, heads, D]
    assert torch.equal(q_rot, want_q)
    assert torch.equal(k_rot, want_k)


@pytest.mark.parametrize("extra", [{}, {"attention_factor": 1.3}, {"factor": 2.5}])
@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_frequencies_equal_transformers(name: str, extra: dict[str, float]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = _config(name)
    config.rope_parameters.update(extra)
    head_dim = config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding(
        config, head_dim, torch.device("cpu"), allow_partial=True, allow_longrope=True
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=ORIGINAL_MAX + 1)
    assert ours.long_inv_freq is not None
    assert torch.equal(ours.inv_freq, short)
    assert torch.equal(ours.long_inv_freq, long)
    assert not torch.equal(short, long)
    assert ours.attention_scaling == factor
    if not extra:
        assert factor == math.sqrt(1 + math.log(64 / 20) / math.log(20))
    # cos/sin per token: each sequence length selects its set, as transformers' forward over
    # that many positions does; one batch mixes lengths on both sides of the switch.
    theirs = Phi3RotaryEmbedding(config)
    lens = torch.tensor([1, 20, 21, 40, 20, 33], dtype=torch.int64)
    positions = lens - 1 - torch.tensor([0, 3, 0, 10, 19, 0])
    cos, sin = ours.cos_sin(positions, lens, torch.float32)  # [6, R]
    for i, (pos, length) in enumerate(zip(positions.tolist(), lens.tolist(), strict=True)):
        want_cos, want_sin = theirs(cos, torch.arange(length)[None])
        assert torch.equal(cos[i], want_cos[0, pos]), i
        assert torch.equal(sin[i], want_sin[0, pos]), i


def _broken(name: str, **changes: Any) -> Any:
    config = _config(name)
    for key, value in changes.items():
        if key.startswith("rope."):
            if value is None:
                del config.rope_parameters[key.removeprefix("rope.")]
            else:
                config.rope_parameters[key.removeprefix("rope.")] = value
        else:
            setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("phi3-swa", {"hidden_act": "gelu_new"}, "hidden_act"),
        ("phi3-swa", {"rope.rope_type": "mystery"}, "rope_type"),
        ("phi3-longrope", {"rope.long_factor": None}, "long_factor"),
        ("phi3-longrope", {"rope.short_factor": [1.0] * 7}, "short_factor"),
        ("phi4-mini", {"rope.long_factor": [1.0] * 8}, "long_factor"),
        ("phi4-mini", {"rope.partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ],
)
def test_unsupported_fields_fail_at_build(name: str, changes: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedModelError, match=field):
        Phi3ForCausalLM(_broken(name, **changes))


def test_shards_split_the_fused_parts_and_partial_rotary_elsewhere_is_refused() -> None:
    """A rank of two holds half of the q heads, half of the KV heads and half of the MLP
    width, within the fused projections (tests/distributed: the tokens)."""
    config = _config("phi3-swa")
    shard = TensorShard(rank=1, world_size=2, all_reduce=lambda x: None)
    layer = Phi3ForCausalLM(config, shard).model.layers[0]
    heads, kv_heads = config.num_attention_heads // 2, config.num_key_value_heads // 2
    d = config.hidden_size // config.num_attention_heads
    assert layer.self_attn.qkv_proj.weight.shape[0] == (heads + 2 * kv_heads) * d
    assert layer.mlp.gate_up_proj.weight.shape[0] == config.intermediate_size
    config = _config("phi4-mini")
    assert rope_parameters(config)["partial_rotary_factor"] == 0.75
    # families that did not opt in
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        RotaryEmbedding(config, 16, torch.device("cpu"), allow_longrope=True)
    with pytest.raises(UnsupportedModelError, match="rope_type 'longrope'"):
        RotaryEmbedding(_config("phi3-longrope"), 16, torch.device("cpu"))


def test_legacy_su_rope_scaling_reads_as_longrope() -> None:
    """Phi-3 hub configs of transformers 4: ``rope_scaling`` of type ``su``, ``rope_theta``."""
    import transformers

    _, kwargs, _ = TINY_MODELS["phi3-longrope"]
    legacy = {k: v for k, v in copy.deepcopy(kwargs).items() if k != "rope_parameters"}
    factors = kwargs["rope_parameters"]
    scaling = {"type": "su", "short_factor": factors["short_factor"]}
    # transformers 5 itself wants original_max_position_embeddings in a legacy "su" dict too
    scaling.update(long_factor=factors["long_factor"], original_max_position_embeddings=20)
    config = transformers.Phi3Config(**legacy, rope_scaling=scaling, rope_theta=10000.0)
    ours = RotaryEmbedding(config, 16, torch.device("cpu"), allow_longrope=True)
    new = RotaryEmbedding(_config("phi3-longrope"), 16, torch.device("cpu"), allow_longrope=True)
    assert ours.rope_type == "longrope"
    assert ours.long_inv_freq is not None and new.long_inv_freq is not None
    assert torch.equal(ours.inv_freq, new.inv_freq)
    assert torch.equal(ours.long_inv_freq, new.long_inv_freq)
    assert ours.attention_scaling == new.attention_scaling
