"""Tiny, seeded, random checkpoints of every supported family, saved as real HF directories.

``build_tiny_checkpoint(name, directory)`` writes ``config.json``, ``model.safetensors`` and the
files of a small byte-level BPE tokenizer trained in-process (offline) on ``CORPUS``. Models are
built with transformers' own classes and ``save_pretrained``, so they are exactly what transformers
would load. Weights are drawn with a larger spread than the default (``initializer_range`` 0.02
makes a random model repeat one token); norms and biases are randomised too, so a mistake in
applying them changes the output.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 320
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

CORPUS = (
    "The paged attention design stores the key value cache of every request in fixed size "
    "blocks, like pages of virtual memory. A block table maps the logical blocks of a sequence "
    "to physical blocks anywhere in the pool, so memory is allocated on demand and shared by "
    "copy on write. The scheduler batches prefill and decode steps of many requests together; "
    "when memory runs out it preempts a request by swapping its blocks to host memory or by "
    "recomputing them later. 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ."
)

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
_LLAMA: dict[str, Any] = {
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


#: Gemma 3 text: local/global layers with their own RoPE, 1 KV head, a scale != head_dim.
TINY_GEMMA3_TEXT: dict[str, Any] = {
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 20,
    "sliding_window": 12,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
    },
    "max_position_embeddings": 256,
}


def _rope(rope_type: str, **params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **params}}


#: name -> (transformers config class name, config kwargs, init std). The stds are tuned so that
#: greedy output stays diverse (test_tiny_models checks it); tied-embedding OPT needs a wider one.
TINY_MODELS: dict[str, tuple[str, dict[str, Any], float]] = {
    "llama-gqa": ("LlamaConfig", {**_LLAMA}, 0.2),
    "llama-mha": (
        "LlamaConfig",
        {**_LLAMA, "num_key_value_heads": 4, "tie_word_embeddings": True},
        0.2,
    ),
    "mistral": ("MistralConfig", {**_LLAMA, "sliding_window": 12}, 0.2),
    "qwen2": ("Qwen2Config", {**_LLAMA}, 0.2),
    "opt": (
        "OPTConfig",
        {
            **_COMMON,
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 64,
            "max_position_embeddings": 256,
            "do_layer_norm_before": True,
        },
        0.3,
    ),
    "opt-post-ln": (
        "OPTConfig",
        {
            **_COMMON,
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 32,
            "max_position_embeddings": 256,
            "do_layer_norm_before": False,
        },
        0.1,
    ),
    "gpt2": (
        "GPT2Config",
        {**_COMMON, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},
        0.15,
    ),
    "llama-rope-linear": ("LlamaConfig", {**_LLAMA, **_rope("linear", factor=2.0)}, 0.2),
    "llama-rope-dynamic": (
        "LlamaConfig",
        {**_LLAMA, "max_position_embeddings": 16, **_rope("dynamic", factor=2.0)},
        0.2,
    ),
    "llama-rope-llama3": (
        "LlamaConfig",
        {
            **_LLAMA,
            **_rope(
                "llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        },
        0.2,
    ),
    "llama-rope-yarn": (
        "LlamaConfig",
        {
            **_LLAMA,
            "max_position_embeddings": 64,
            **_rope("yarn", factor=4.0, original_max_position_embeddings=16),
        },
        0.2,
    ),
    # ---- Qwen3, Qwen3-MoE, Mixtral ----
    # head_dim 32 != hidden / heads (16); GQA 2; untied.
    "qwen3": ("Qwen3Config", {**_LLAMA, "head_dim": 32}, 0.2),
    # GQA 4, tied, q/k/v/o biases; layer 1 slides (window 12 < the prompts), layer 0 does not.
    "qwen3-sliding-tied": (
        "Qwen3Config",
        {
            **_LLAMA,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 12,
            "max_window_layers": 1,
        },
        0.25,
    ),
    # 8 experts top-2, renormalised; head_dim 32.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            **_LLAMA,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        0.2,
    ),
    # 4 experts top-3, not renormalised; layer 0 dense (mlp_only_layers); window 12 everywhere.
    "qwen3-moe-dense-sliding": (
        "Qwen3MoeConfig",
        {
            **_LLAMA,
            "num_experts": 4,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
            "use_sliding_window": True,
            "sliding_window": 12,
        },
        0.2,
    ),
    # 6 experts top-2 (always renormalised), window 12 on every layer, GQA 2.
    "mixtral": (
        "MixtralConfig",
        {
            **_LLAMA,
            "intermediate_size": 64,
            "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "sliding_window": 12,
        },
        0.2,
    ),
    # ---- Gemma 2, Gemma 3 ----
    # head_dim x heads != hidden, query_pre_attn_scalar != head_dim, windows shorter than the
    # prompts, softcaps that saturate. Norm weights are zero-centred here (1 + w applied), so the
    # randomised 1 + 0.1 noise doubles each norm's scale (with noise), which transformers applies.
    "gemma2": (
        "Gemma2Config",
        {
            **_COMMON,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,  # sliding, full, sliding
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 12,
            "attn_logit_softcapping": 8.0,
            "final_logit_softcapping": 10.0,
            "tie_word_embeddings": False,  # tied, this random model repeats its input token
            "max_position_embeddings": 256,
        },
        0.2,
    ),
    "gemma3": ("Gemma3TextConfig", {**TINY_GEMMA3_TEXT}, 0.1),
    # gemma-3-4b-it-like: the same language model inside a multimodal checkpoint (its weights
    # under language_model., a small vision tower the engine does not load).
    "gemma3-multimodal": (
        "Gemma3Config",
        {
            "text_config": {**TINY_GEMMA3_TEXT},
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            "mm_tokens_per_image": 4,
        },
        0.1,
    ),
    # ---- Phi-3 ----
    "phi3-swa": (  # Phi-3-mini-4k-like: default RoPE, a sliding window shorter than the prompts
        "Phi3Config",
        {**_LLAMA, "sliding_window": 12, "original_max_position_embeddings": 256},
        0.2,
    ),
    "phi3-longrope": (  # Phi-3.5-like: MHA, longrope switching at 20 tokens
        "Phi3Config",
        {
            **_LLAMA,
            "num_key_value_heads": 4,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 20,
            **_rope(
                "longrope",
                short_factor=[1.0 + 0.13 * ((5 * i) % 7) for i in range(8)],
                long_factor=[1.0 + 1.7 * ((3 * i) % 8) for i in range(8)],
            ),
        },
        0.2,
    ),
    "phi4-mini": (  # Phi-4-mini-like: GQA 4:1, tied, partial rotary 0.75 (12 of 16), longrope
        "Phi3Config",
        {
            **_LLAMA,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 20,
            **_rope(
                "longrope",
                short_factor=[1.0 + 0.11 * ((4 * i) % 5) for i in range(6)],
                long_factor=[1.0 + 2.3 * ((5 * i) % 6) for i in range(6)],
            ),
        },
        0.2,
    ),
}

#: transformers config class -> model class, where it is not ``*Config`` -> ``*ForCausalLM``.
_MODEL_CLASSES = {
    "GPT2Config": "GPT2LMHeadModel",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
    "Gemma3Config": "Gemma3ForConditionalGeneration",
}


def model_class_name(config_cls_name: str) -> str:
    """The transformers causal-LM class built for a config class name."""
    default = config_cls_name.removesuffix("Config") + "ForCausalLM"
    return _MODEL_CLASSES.get(config_cls_name, default)


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` ids with <pad>/<s>/</s>/<unk> as ids 0-3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    return as_transformers_tokenizer(tok)


def as_transformers_tokenizer(tok: Any) -> Any:
    """A ``tokenizers.Tokenizer`` whose ids 0-3 are <pad>/<s>/</s>/<unk>, as a transformers
    fast tokenizer (what ``save_pretrained`` writes and ``AutoTokenizer`` loads)."""
    from transformers import PreTrainedTokenizerFast

    pad, bos, eos, unk = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk
    )


def _randomise(model: torch.nn.Module, std: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("bias"):
                param.copy_(noise * std)
            elif param.dim() == 1:  # norm weights
                param.copy_(1.0 + noise * 0.1)
            else:
                param.copy_(noise * std)


def build_tiny_model(
    name: str, seed: int = 0, config_overrides: dict[str, Any] | None = None
) -> Any:
    """The transformers model (float32, eval mode) for ``name`` in ``TINY_MODELS``, with
    ``config_overrides`` applied to its config kwargs."""
    import transformers

    config_cls_name, kwargs, std = TINY_MODELS[name]
    config = getattr(transformers, config_cls_name)(**{**kwargs, **(config_overrides or {})})
    model_cls: Callable[[Any], Any] = getattr(transformers, model_class_name(config_cls_name))
    torch.manual_seed(seed)
    model = model_cls(config)
    generator = torch.Generator().manual_seed(seed)
    _randomise(model, std, generator)
    model.tie_weights()
    return model.eval()


def build_tiny_checkpoint(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Save model ``name`` (see ``TINY_MODELS``) with its tokenizer into ``directory``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_model(name, seed).save_pretrained(str(path))
    build_tokenizer().save_pretrained(str(path))
    return path
