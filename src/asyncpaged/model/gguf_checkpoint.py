"""A GGUF file (or split set) read as a transformers checkpoint: config, tokenizer, and the
file's tensors under the parameter names of transformers' models, still quantized.

``open_gguf_checkpoint(path)`` validates the file (``gguf_file.open_gguf``), refuses an
architecture outside ``GGUF_ARCHITECTURES`` (UnsupportedModelError), builds the config with
transformers' own GGUF reading (``AutoConfig.from_pretrained(dir, gguf_file=name)``) and maps every
tensor to a parameter name (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``).
``load_gguf_tokenizer(path)`` is transformers' tokenizer built from the ``tokenizer.*`` metadata.

Two things llama.cpp's converter changes in the weights are recorded on each ``GGUFTensor``
rather than undone in the bytes (``dequantize`` applies both):

- **llama's Q/K permutation.** For the ``llama`` architecture (Llama, Mistral) llama.cpp permutes
  the rows of ``q_proj`` and ``k_proj`` (weights and biases) so that each head's two rotary halves
  become interleaved pairs (its rotary kernel rotates adjacent pairs)::

      stored row  h*d + 2*j + s   holds   transformers' row  h*d + s*(d/2) + j
      (h: head, d: head_dim, j < d/2, s in {0, 1}; heads: query heads for Q, KV heads for K)

  This moves whole rows, and a quantized row is whole blocks, so nothing is re-quantized:
  ``row_permutation[i]`` is the stored row that transformers' row ``i`` is. A kernel can read the
  stored rows in that order, or multiply by the stored matrix and permute the output features.
  transformers undoes the same permutation (``reverse_permute`` in ``modeling_gguf_pytorch_utils``).
- **Gemma's norm weights** are stored plus one; ``value_offset`` is -1.

Qwen3-MoE experts are stored stacked (``blk.N.ffn_gate_exps.weight``, ``[experts, rows, cols]``);
each expert is a contiguous byte range of it, so it becomes one record per expert
(``model.layers.N.mlp.experts.E.gate_proj.weight``), a view of those bytes.

The config follows transformers where transformers reads a field, with three exceptions checked
here: ``architectures`` is set (transformers leaves it empty), ``tie_word_embeddings`` follows
the tensors of every part (transformers looks at the first part only), and where the file states a
``head_dim`` (``attention.key_length``) or a Qwen3-MoE expert width that transformers does not read,
the two must agree (else UnsupportedModelError naming the field: the shapes would not fit).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncpaged.model.errors import CheckpointError, GGUFError, UnsupportedModelError
from asyncpaged.model.gguf_file import (
    GGMLType,
    GGUFFile,
    GGUFTensor,
    check_metadata_types,
    open_gguf,
)

#: llama.cpp architecture -> the transformers class whose parameter names the tensors get
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",  # "MistralForCausalLM" where transformers reads a Mistral
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

#: transformers model_type -> architectures entry
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

#: types of the ``<arch>.*`` keys transformers reads for these families
ARCH_SCHEMA: dict[str, str] = {
    "context_length": "int",
    "embedding_length": "int",
    "block_count": "int",
    "feed_forward_length": "int",
    "attention.head_count": "int",
    "attention.head_count_kv": "int",
    "attention.key_length": "int",
    "attention.value_length": "int",
    "attention.sliding_window": "int",
    "attention.layer_norm_rms_epsilon": "float",
    "rope.dimension_count": "int",
    "rope.freq_base": "float",
    "expert_count": "int",
    "expert_used_count": "int",
    "expert_feed_forward_length": "int",
    "vocab_size": "int",
}

#: the model's token embedding (GGUF's ``token_embd``), by the name the families give it
TOKEN_EMBEDDING = "model.embed_tokens.weight"
_TOP_LEVEL = {
    "token_embd": TOKEN_EMBEDDING.removesuffix(".weight"),
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: per-architecture differences from _BLOCK
_BLOCK_BY_ARCH: dict[str, dict[str, str]] = {
    "qwen3moe": {"ffn_gate_inp": "mlp.gate"},
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_BLOCK_BY_ARCH["gemma3"] = _BLOCK_BY_ARCH["gemma2"]
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>[a-z0-9_]+)\.(?P<kind>weight|bias)$")
_TOP_NAME = re.compile(r"^(?P<part>[a-z0-9_]+)\.(?P<kind>weight|bias)$")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GGUFCheckpoint:
    """A validated GGUF file as a transformers checkpoint.

    ``tensors`` maps each parameter name of transformers' model (per-expert names for MoE) to a
    record whose bytes are a view of the mapped file; every tensor of the file maps to at least
    one name, and no name is mapped twice."""

    file: GGUFFile
    config: Any  # a transformers PretrainedConfig
    tensors: Mapping[str, GGUFTensor]

    @property
    def path(self) -> Path:
        """The file to hand to transformers (the first part of a split set)."""
        return self.file.paths[0]


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix)."""
    return str(path).endswith(".gguf")


def open_gguf_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """Validate the GGUF file (or split set) at ``path`` and read it as a checkpoint (see the
    module docstring). GGUFError for a malformed file, UnsupportedModelError for an architecture,
    tensor type or tensor this module does not map."""
    file = open_gguf(path)
    arch = file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{str(file.paths[0])!r}: GGUF architecture {arch!r} is not supported; supported: "
            f"{sorted(GGUF_ARCHITECTURES)}."
        )
    check_metadata_types(file.paths[0], file.metadata,
                         {f"{arch}.{key}": kind for key, kind in ARCH_SCHEMA.items()})  # fmt: skip
    config = load_gguf_config(file)
    tensors: dict[str, GGUFTensor] = {}
    for tensor in file.tensors.values():
        for mapped in _mapped(tensor, arch, config, file.paths[0]):
            if mapped.name in tensors:
                raise GGUFError(f"{str(tensor.path)!r}: two tensors map to {mapped.name!r}.")
            tensors[mapped.name] = mapped
    return GGUFCheckpoint(file=file, config=config, tensors=tensors)


def load_gguf_config(file: GGUFFile) -> Any:
    """transformers' config for the file (``AutoConfig.from_pretrained(dir, gguf_file=name)``),
    with ``architectures`` and ``tie_word_embeddings`` set and checked as the module says."""
    from transformers import AutoConfig

    first = file.paths[0]
    try:
        config = AutoConfig.from_pretrained(str(first.parent), gguf_file=first.name)
    except (ValueError, KeyError, TypeError, OSError, IndexError) as exc:
        raise CheckpointError(f"transformers cannot read the config of {str(first)!r}: {exc}"
                              ) from exc  # fmt: skip
    cls = _CLASSES.get(config.model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"{str(first)!r}: transformers reads model_type {config.model_type!r}, which "
            "asyncpaged does not load from GGUF."
        )
    config.architectures = [cls]
    config.tie_word_embeddings = "output.weight" not in file.tensors
    arch = file.architecture
    stated = {
        "head_dim": file.metadata.get(f"{arch}.attention.key_length"),
        "moe_intermediate_size": file.metadata.get(f"{arch}.expert_feed_forward_length"),
    }
    for field, value in stated.items():
        read = getattr(config, field, None)
        if value is not None and read is not None and read != value:
            key = "attention.key_length" if field == "head_dim" else "expert_feed_forward_length"
            raise UnsupportedModelError(
                f"{str(first)!r}: the file states {arch}.{key} = {value}, but transformers reads "
                f"{field} = {read} for this architecture; the weights would not fit."
            )
    return config


def load_gguf_tokenizer(path: str | Path) -> Any:
    """transformers' tokenizer (with the chat template) from the file's ``tokenizer.*`` metadata
    (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``; the first part of a split set)."""
    from transformers import AutoTokenizer

    first = open_gguf(path).paths[0]
    try:
        return AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name)
    except (ValueError, KeyError, TypeError, OSError, IndexError) as exc:
        raise CheckpointError(f"cannot build a tokenizer from {str(first)!r}: {exc}") from exc


def llama_row_permutation(num_rows: int, num_heads: int) -> tuple[int, ...]:
    """``perm`` with transformers' row ``i`` = stored row ``perm[i]``, for a Q or K projection of
    ``num_rows`` rows over ``num_heads`` heads permuted by llama.cpp (see the module docstring)."""
    if num_heads <= 0 or num_rows % (2 * num_heads):
        raise UnsupportedModelError(
            f"a Q/K projection of {num_rows} rows cannot be split into {num_heads} heads of "
            "rotary pairs."
        )
    stored_to_hf = np.arange(num_rows).reshape(num_heads, 2, -1).swapaxes(1, 2).reshape(-1)
    return tuple(np.argsort(stored_to_hf).tolist())


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as transformers holds it, in float32: dequantized (``gguf.quants``), rows
    un-permuted, value offset added. A new tensor; for references and tests."""
    import gguf

    raw = tensor.data
    if tensor.qtype is GGMLType.F32:
        values = raw.view("<f4")
    elif tensor.qtype is GGMLType.F16:
        values = raw.view("<f2").astype(np.float32)
    else:
        rows = raw.reshape(tensor.num_rows, tensor.row_bytes)
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(tensor.qtype)))
    out = torch.from_numpy(np.array(values, dtype=np.float32).reshape(tensor.shape))
    if tensor.row_permutation is not None:
        out = out[torch.tensor(tensor.row_permutation)]
    if tensor.value_offset:
        out += tensor.value_offset
    return out


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The transformers parameter a GGUF tensor name maps to, or None (per-expert stacks and
    unknown names)."""
    top = _TOP_NAME.match(gguf_name)
    if top is not None and top["part"] in _TOP_LEVEL:
        return f"{_TOP_LEVEL[top['part']]}.{top['kind']}"
    block = _BLOCK_NAME.match(gguf_name)
    if block is None:
        return None
    part = {**_BLOCK, **_BLOCK_BY_ARCH.get(arch, {})}.get(block["part"])
    if part is None:
        return None
    return f"model.layers.{block['layer']}.{part}.{block['kind']}"


def _mapped(tensor: GGUFTensor, arch: str, config: Any, path: Path) -> list[GGUFTensor]:
    block = _BLOCK_NAME.match(tensor.name)
    if arch == "qwen3moe" and block is not None and block["part"] in _EXPERTS:
        return _experts(
            tensor, f"model.layers.{block['layer']}.mlp.experts", _EXPERTS[block["part"]]
        )
    name = hf_name(tensor.name, arch)
    if name is None:
        raise UnsupportedModelError(
            f"{str(path)!r}: tensor {tensor.name!r} has no counterpart in transformers' "
            f"{GGUF_ARCHITECTURES[arch]} (asyncpaged maps: {sorted(_TOP_LEVEL)} and blk.N.* "
            f"{sorted({**_BLOCK, **_BLOCK_BY_ARCH.get(arch, {})})})."
        )
    permutation = None
    if arch == "llama" and block is not None and block["part"] in ("attn_q", "attn_k"):
        heads = (
            config.num_attention_heads if block["part"] == "attn_q" else config.num_key_value_heads
        )
        permutation = llama_row_permutation(tensor.shape[0], heads)
    offset = -1.0 if arch in ("gemma2", "gemma3") and tensor.name.endswith("norm.weight") else 0.0
    return [
        dataclasses.replace(tensor, name=name, row_permutation=permutation, value_offset=offset)
    ]


def _experts(tensor: GGUFTensor, prefix: str, proj: str) -> list[GGUFTensor]:
    if len(tensor.shape) != 3:
        raise GGUFError(
            f"{str(tensor.path)!r}: expert stack {tensor.name!r} has shape {list(tensor.shape)}, "
            "not [experts, rows, cols]."
        )
    count = tensor.shape[0]
    each = tensor.nbytes // count
    return [
        dataclasses.replace(
            tensor,
            name=f"{prefix}.{e}.{proj}.weight",
            shape=tensor.shape[1:],
            nbytes=each,
            data=tensor.data[e * each : (e + 1) * each],
            offset=tensor.offset + e * each,
        )
        for e in range(count)
    ]
