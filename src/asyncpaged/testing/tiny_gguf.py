"""Tiny GGUF files written from the tiny transformers models of ``tiny_models``.

``write_tiny_gguf(name, path, qtypes=...)`` writes what llama.cpp's ``convert_hf_to_gguf.py``
would for the model: llama.cpp's metadata keys, its tensor names (``gguf.get_tensor_name_map``),
llama's Q and K projections permuted as llama.cpp permutes them, Qwen3-MoE experts stacked into
``ffn_{gate,up,down}_exps``, and the tokenizer as ``tokenizer.ggml.*`` keys (model ``gpt2``, the
tokens, token types, merges, special ids) with a chat template. transformers'
``from_pretrained(dir, gguf_file=name)`` loads the file back to the same model: exactly, for
F32 weights.

Types: each tensor gets ``qtypes.get(gguf_name, default)``; one-dimensional tensors (norms,
biases) stay F32 unless named, as llama.cpp keeps them. F32, F16, BF16, Q8_0 and Q4_0 are
quantized from the weights with ``gguf.quants.quantize``. gguf-py cannot quantize K-quants, so a
Q4_K, Q5_K or Q6_K tensor is written as random but valid blocks (random scale and quant bytes,
finite float16 super-block scales): the file then no longer holds the model's weights, only a
tensor of the right shape. K-quant rows are 256 elements; ``TINY_GGUF_MODELS["llama-wide"]`` has
such rows everywhere.

Split sets: ``split_max_tensors=N`` writes ``<stem>-00001-of-0000M.gguf`` parts of at most N tensors
(GGUFWriter's own splitting; the metadata is in the first part) and returns the first part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncpaged.testing.tiny_models import BOS_ID, EOS_ID, PAD_ID, UNK_ID, build_tiny_model
from asyncpaged.testing.tiny_models import build_tokenizer as build_hf_tokenizer

#: name -> (TINY_MODELS name, config overrides)
TINY_GGUF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama-gqa", {}),
    "llama-mha": ("llama-mha", {}),  # tied embeddings: no output.weight
    "qwen2": ("qwen2", {}),
    # transformers reads no head_dim from a qwen3 GGUF (Qwen3Config's default, 128, applies)
    "qwen3": ("qwen3", {"head_dim": 128}),
    # nor moe_intermediate_size from a qwen3moe one (the default, 768, applies)
    "qwen3-moe": ("qwen3-moe", {"num_experts": 4, "moe_intermediate_size": 768}),
    # rows of 256 (and 64 per head) everywhere, for the K-quants
    "llama-wide": ("llama-gqa", {"hidden_size": 256, "intermediate_size": 256,
                                 "num_hidden_layers": 1}),
}  # fmt: skip

#: transformers model_type -> llama.cpp architecture
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

#: the float16 super-block scale fields of each K-quant block: (byte offset, count)
_K_QUANT_HALVES = {"Q4_K": ((0, 2),), "Q5_K": ((0, 2),), "Q6_K": ((208, 1),)}


def llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of a Q or K projection's rows (``num_heads``: the query
    heads for Q, the KV heads for K): each head's rotary halves become interleaved pairs."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's float32 weights under llama.cpp's names, in llama.cpp's layout."""
    import gguf

    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, param in model.state_dict().items():
        weight = param.detach().to(torch.float32).numpy().copy()
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if hf_name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate, then up
            base = name_map.get_name(hf_name.replace("gate_up_proj", "down_proj"))
            assert base is not None, hf_name
            half = weight.shape[1] // 2
            out[base.replace("down", "gate") + ".weight"] = weight[:, :half]
            out[base.replace("down", "up") + ".weight"] = weight[:, half:]
            continue
        stem, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            stem, suffix = hf_name, "weight"
        gguf_name = name_map.get_name(stem)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        if arch == "llama" and stem.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            is_q = stem.endswith("q_proj")
            heads = config.num_attention_heads if is_q else config.num_key_value_heads
            weight = llama_permute(weight, heads)
        out[f"{gguf_name}.{suffix}"] = weight
    return out


def _metadata(writer: Any, config: Any, arch: str, name: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_file_type(0)


def _tokenizer_metadata(writer: Any, chat_template: str, vocab_size: int) -> None:
    """The tiny tokenizer; a model with a larger vocabulary (a benchmark's real-sized one) gets
    ``<unused_i>`` tokens of type UNUSED (5) up to its size, as released models pad theirs."""
    tokenizer = build_hf_tokenizer()
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {PAD_ID, BOS_ID, EOS_ID, UNK_ID}
    types = [3 if i in special else 1 for i in range(len(tokens))]
    padding = max(0, vocab_size - len(tokens))
    tokens += [f"<unused_{i}>" for i in range(padding)]
    types += [5] * padding
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(pair) for pair in spec["model"]["merges"]])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)


def random_k_quant_rows(qtype: str, num_rows: int, row_length: int, seed: int) -> np.ndarray:
    """``uint8 [num_rows, row_bytes]`` of valid ``qtype`` (Q4_K/Q5_K/Q6_K) blocks: random quant
    and scale bytes, float16 super-block scales drawn in [1e-3, 2e-2)."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    num_blocks = num_rows * row_length // block_size
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for start, count in _K_QUANT_HALVES[qtype]:
        halves = rng.uniform(1e-3, 2e-2, size=(num_blocks, count)).astype("<f2")
        blocks[:, start : start + 2 * count] = halves.view(np.uint8)
    return blocks.reshape(num_rows, -1)


def encode_tensor(weight: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """``weight`` (float32) stored as ``qtype``: float arrays for F32/F16, raw bytes otherwise."""
    import gguf

    if qtype == "F32":
        return weight.astype(np.float32)
    if qtype == "F16":
        return weight.astype(np.float16)
    if qtype in _K_QUANT_HALVES:
        rows = random_k_quant_rows(qtype, weight.size // weight.shape[-1], weight.shape[-1], seed)
        return rows.reshape(*weight.shape[:-1], -1)
    encoded: np.ndarray = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[qtype])
    return encoded


def write_gguf_tensors(writer: Any, tensors: Mapping[str, np.ndarray],
                       qtypes: Mapping[str, str], default: str) -> None:  # fmt: skip
    """Add ``tensors`` (float32, llama.cpp layout) to ``writer`` with their chosen types."""
    import gguf

    for index, (name, weight) in enumerate(tensors.items()):
        qtype = qtypes.get(name, default if weight.ndim > 1 else "F32")
        data = encode_tensor(weight, qtype, seed=index)
        raw = gguf.GGMLQuantizationType[qtype]
        if qtype in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw)


def write_tiny_gguf(
    name: str,
    path: str | Path,
    *,
    default: str = "F32",
    qtypes: Mapping[str, str] | None = None,
    split_max_tensors: int = 0,
    chat_template: str = CHAT_TEMPLATE,
    seed: int = 0,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write ``TINY_GGUF_MODELS[name]`` as a GGUF file at ``path`` (the first part of a split set
    when ``split_max_tensors`` splits it); returns the path to open. ``extra_tensors`` (float32,
    GGUF names) are written after the model's."""
    import gguf

    base, overrides = TINY_GGUF_MODELS[name]
    model = build_tiny_model(base, seed, overrides)
    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(file, arch, split_max_tensors=split_max_tensors)
    _metadata(writer, config, arch, f"tiny-{name}")
    _tokenizer_metadata(writer, chat_template, int(config.vocab_size))
    tensors = {**gguf_tensors(model), **(extra_tensors or {})}
    write_gguf_tensors(writer, tensors, qtypes or {}, default)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        parts = sorted(file.parent.glob(f"{file.stem}-00001-of-*.gguf"))
        if parts:
            return parts[0]
    return file


def load_transformers_gguf(path: str | Path) -> Any:
    """transformers' own reading of a GGUF file, as a float32 model in eval mode: the config from
    ``AutoConfig.from_pretrained(dir, gguf_file=name)`` and the weights dequantized (and llama's
    Q/K un-permuted) by ``load_gguf_checkpoint``. ``from_pretrained(gguf_file=...)`` does the
    same but needs accelerate, which asyncpaged does not depend on."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    file = Path(path)
    config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    parsed = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model)  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise AssertionError(
            f"transformers read {file}: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model.eval()
