"""GGUF files as transformers checkpoints (``model/gguf_checkpoint.py``) and the tiny GGUF writer
(``testing/tiny_gguf.py``): every dequantized tensor equals transformers' own reading of the file
(Q/K un-permutation included), F32 files reload to the original model exactly, the tokenizer is
transformers', and the refusals are typed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncpaged.model.base import TensorShard
from asyncpaged.model.errors import GGUFError, UnsupportedModelError
from asyncpaged.model.gguf_checkpoint import (
    GGUF_ARCHITECTURES,
    TOKEN_EMBEDDING,
    dequantize,
    hf_name,
    llama_row_permutation,
    load_gguf_tokenizer,
    open_gguf_checkpoint,
)
from asyncpaged.model.gguf_file import open_gguf
from asyncpaged.model.gguf_weight import GGUFWeight
from asyncpaged.model.loader import load_model

gguf = pytest.importorskip("gguf")

from asyncpaged.testing.tiny_gguf import (  # noqa: E402 (needs gguf)
    TINY_GGUF_MODELS,
    llama_permute,
    load_transformers_gguf,
    write_tiny_gguf,
)
from asyncpaged.testing.tiny_models import build_tiny_model, build_tokenizer  # noqa: E402

PROMPT = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 7]])


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _write(directory: Path, name: str, default: str, **kwargs: Any) -> Path:
    return write_tiny_gguf(name, directory / f"{name}-{default}.gguf", default=default, **kwargs)


def _transformers_param(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """transformers' tensor for one of our names (its experts are fused: gate_up, down)."""
    expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
    if expert is None:
        return state[name]
    index = int(expert[2])
    if expert[3] == "down":
        return state[f"{expert[1]}.down_proj"][index]
    fused = state[f"{expert[1]}.gate_up_proj"][index]
    half = fused.shape[0] // 2
    return fused[:half] if expert[3] == "gate" else fused[half:]


CASES = [
    ("llama-gqa", "F32"),
    ("llama-gqa", "Q8_0"),
    ("llama-mha", "F16"),
    ("qwen2", "BF16"),
    ("qwen3", "Q4_0"),
    ("qwen3-moe", "Q8_0"),
    ("llama-wide", "Q4_K"),
    ("llama-wide", "Q5_K"),
    ("llama-wide", "Q6_K"),
]


@pytest.mark.parametrize(("name", "default"), CASES)
def test_dequantize_equals_transformers(gguf_dir: Path, name: str, default: str) -> None:
    path = _write(gguf_dir, name, default)
    checkpoint = open_gguf_checkpoint(path)
    reference = load_transformers_gguf(path)
    state = reference.state_dict()
    assert checkpoint.config.architectures == [type(reference).__name__]
    assert checkpoint.config.tie_word_embeddings == reference.config.tie_word_embeddings
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rms_norm_eps", "head_dim"):  # fmt: skip
        assert getattr(checkpoint.config, key, None) == getattr(reference.config, key, None), key
    for tensor_name, tensor in checkpoint.tensors.items():
        assert torch.equal(dequantize(tensor), _transformers_param(state, tensor_name)), tensor_name
        if tensor.qtype.name == default and default not in ("F32", "F16"):
            assert tensor.data.base is not None  # a view of the mapped file, not a copy
    expected = {
        k for k in state if not (k == "lm_head.weight" and reference.config.tie_word_embeddings)
    }
    ours = {
        re.sub(r"experts\.\d+\.(gate|up)_proj\.weight", "experts.gate_up_proj", k)
        for k in checkpoint.tensors
    }
    ours = {re.sub(r"experts\.\d+\.down_proj\.weight", "experts.down_proj", k) for k in ours}
    assert ours == expected
    embedding = checkpoint.tensors[TOKEN_EMBEDDING]
    if embedding.qtype.block_size > 1:  # kept quantized: a lookup dequantizes only its rows
        table = GGUFWeight.from_rows(embedding.rows(), embedding.qtype.name,
                                     int(embedding.shape[1]), None)  # fmt: skip
        ids = torch.tensor([0, 5, 5, reference.config.vocab_size - 1, 3])
        assert torch.equal(table.rows(ids), state[TOKEN_EMBEDDING][ids])
        with pytest.raises(IndexError):
            table.rows(torch.tensor([reference.config.vocab_size]))


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha", "qwen2", "qwen3", "qwen3-moe"])
def test_f32_file_reloads_to_the_original_model(gguf_dir: Path, name: str) -> None:
    path = _write(gguf_dir, name, "F32")
    base, overrides = TINY_GGUF_MODELS[name]
    original = build_tiny_model(base, 0, overrides)
    reloaded = load_transformers_gguf(path)
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT).logits, original(PROMPT).logits)
    # and ours, without transformers' reading: every tensor is the original parameter
    state = original.state_dict()
    for tensor_name, tensor in open_gguf_checkpoint(path).tensors.items():
        assert torch.equal(dequantize(tensor), _transformers_param(state, tensor_name)), tensor_name


def test_q8_0_file_is_close_to_the_original(gguf_dir: Path) -> None:
    path = _write(gguf_dir, "llama-gqa", "Q8_0")
    original = build_tiny_model("llama-gqa")
    with torch.no_grad():
        got, want = load_transformers_gguf(path)(PROMPT).logits, original(PROMPT).logits
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # Q8_0: ~0.5% per weight
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))


def test_llama_qk_rows_are_permuted_in_the_file_and_restored(gguf_dir: Path) -> None:
    checkpoint = open_gguf_checkpoint(_write(gguf_dir, "llama-gqa", "Q8_0"))
    original = build_tiny_model("llama-gqa").state_dict()
    q = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    k = checkpoint.tensors["model.layers.0.self_attn.k_proj.weight"]
    v = checkpoint.tensors["model.layers.0.self_attn.v_proj.weight"]
    assert q.row_permutation == llama_row_permutation(64, 4)  # 4 query heads of 16
    assert k.row_permutation == llama_row_permutation(32, 2)  # 2 KV heads of 16
    assert v.row_permutation is None
    # row-level: dequantizing stored rows, then reordering, is what transformers holds
    stored = dequantize(dataclass_replace(q, row_permutation=None))
    assert not torch.equal(stored, dequantize(q))
    assert torch.equal(stored[list(q.row_permutation)], dequantize(q))
    torch.testing.assert_close(dequantize(q), original["model.layers.0.self_attn.q_proj.weight"],
                               atol=0.02, rtol=0.02)  # fmt: skip
    # no permutation outside llama
    qwen = open_gguf_checkpoint(_write(gguf_dir, "qwen2", "BF16"))
    assert all(t.row_permutation is None for t in qwen.tensors.values())


def dataclass_replace(tensor: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(tensor, **changes)


@pytest.mark.parametrize(("rows", "heads"), [(8, 1), (64, 4), (32, 2), (512, 4), (24, 3)])
def test_row_permutation_inverts_llama_cpp_permute(rows: int, heads: int) -> None:
    weight = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    stored = llama_permute(weight, heads)
    assert np.array_equal(stored[list(llama_row_permutation(rows, heads))], weight)
    bias = np.arange(rows, dtype=np.float32)
    assert np.array_equal(
        llama_permute(bias, heads)[list(llama_row_permutation(rows, heads))], bias
    )
    with pytest.raises(UnsupportedModelError):
        llama_row_permutation(rows + 1, heads)


def test_split_set_equals_the_single_file(gguf_dir: Path) -> None:
    single = open_gguf_checkpoint(_write(gguf_dir, "qwen3-moe", "Q4_0"))
    split = open_gguf_checkpoint(
        write_tiny_gguf(
            "qwen3-moe", gguf_dir / "split" / "m.gguf", default="Q4_0", split_max_tensors=7
        )
    )
    assert len(split.file.paths) == 4 and split.path.name == "m-00001-of-00004.gguf"
    assert split.config.to_dict() | {"_name_or_path": ""} == single.config.to_dict() | {
        "_name_or_path": ""
    }
    assert list(split.tensors) == list(single.tensors)
    for name, tensor in single.tensors.items():
        assert torch.equal(dequantize(split.tensors[name]), dequantize(tensor)), name
    assert len(split.tensors) == 2 * (4 * 3 + 9) + 3  # per-expert records, 4 experts


TEXTS = ["hello world", "The paged attention design stores the key value cache.",
         " leading space", "<s>special</s> tokens", "0123 ÄÖü ☃ emoji 🙂", ""]  # fmt: skip


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_tokenizer_equals_the_original(gguf_dir: Path, name: str) -> None:
    """transformers builds a byte-level tokenizer (GPT2Tokenizer; Qwen2Tokenizer for qwen2) from
    the metadata; both add their default <|endoftext|> when the vocabulary lacks it (id 320 here,
    past the tiny model's rows; real vocabularies hold it). Everything else is the original's."""
    ours, original = load_gguf_tokenizer(_write(gguf_dir, name, "F32")), build_tokenizer()
    vocab = ours.get_vocab()
    assert set(vocab) - set(original.get_vocab()) == {"<|endoftext|>"}
    assert {k: v for k, v in vocab.items() if k != "<|endoftext|>"} == original.get_vocab()
    for text in TEXTS:
        assert ours(text).input_ids == original(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == original.decode(original(text).input_ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 0)
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                        add_generation_prompt=True)  # fmt: skip
    assert rendered == "<s>user\nhi</s>\n<s>assistant\n"


def test_names_agree_with_gguf_py() -> None:
    """Our GGUF -> transformers names invert gguf-py's transformers -> GGUF map, for every family
    (the tiny transformers models' parameters; fused MoE experts aside)."""
    families = {"llama-gqa": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3moe",
                "gemma2": "gemma2", "gemma3": "gemma3", "phi3-swa": "phi3"}  # fmt: skip
    assert set(families.values()) == set(GGUF_ARCHITECTURES)
    for tiny, arch in families.items():
        model = build_tiny_model(tiny)
        arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
        name_map = gguf.get_tensor_name_map(arch_enum, model.config.num_hidden_layers)
        for key in model.state_dict():
            stem, _, suffix = key.rpartition(".")
            if ".experts." in key or (key == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            gguf_name = name_map.get_name(stem)
            if key == "lm_head.weight" and arch in ("gemma2", "gemma3"):
                assert gguf_name is None  # llama.cpp's Gemma always ties the head
                continue
            assert gguf_name is not None, key
            assert hf_name(f"{gguf_name}.{suffix}", arch) == key, (arch, key, gguf_name)


def test_refusals(gguf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    path = write_tiny_gguf("llama-gqa", tmp_path / "rope.gguf", extra_tensors=extra)
    with pytest.raises(UnsupportedModelError, match=r"rope_freqs\.weight"):
        open_gguf_checkpoint(path)
    # a file stating a head_dim that transformers does not read for qwen3
    monkeypatch.setitem(TINY_GGUF_MODELS, "qwen3-narrow", ("qwen3", {}))
    with pytest.raises(UnsupportedModelError, match=r"attention\.key_length = 32"):
        open_gguf_checkpoint(write_tiny_gguf("qwen3-narrow", tmp_path / "narrow.gguf"))
    # an architecture outside the list, and an arch key of the wrong type
    raw = (_write(gguf_dir, "llama-gqa", "F32")).read_bytes()
    renamed = raw.replace(
        b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00bloom", 1
    )
    (tmp_path / "bloom.gguf").write_bytes(renamed)
    assert open_gguf(tmp_path / "bloom.gguf").architecture == "bloom"
    with pytest.raises(UnsupportedModelError, match="'bloom' is not supported"):
        open_gguf_checkpoint(tmp_path / "bloom.gguf")
    key = b"llama.block_count"
    at = raw.index(key) + len(key)
    assert raw[at : at + 4] == b"\x04\x00\x00\x00"  # uint32
    (tmp_path / "typed.gguf").write_bytes(raw[:at] + b"\x06" + raw[at + 1 :])  # float32
    with pytest.raises(GGUFError, match=r"llama\.block_count"):
        open_gguf_checkpoint(tmp_path / "typed.gguf")


def test_tensor_parallelism_and_devices_without_kernels_are_refused(gguf_dir: Path) -> None:
    """GGUF weights multiply on the CPU or on CUDA (Triton), on one rank."""
    path = _write(gguf_dir, "llama-gqa", "Q8_0")
    shard = TensorShard(rank=0, world_size=2, all_reduce=lambda t: None)
    with pytest.raises(UnsupportedModelError, match="no tensor parallelism"):
        load_model(path, dtype="float32", shard=shard)
    with pytest.raises(UnsupportedModelError, match="runs on the CPU or CUDA, not on 'meta'"):
        load_model(path, dtype="float32", device="meta")
