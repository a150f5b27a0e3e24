"""The tiny checkpoints are real transformers directories with usable, non-degenerate output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncpaged.model.loader import load_tokenizer
from asyncpaged.testing.tiny_models import BOS_ID, EOS_ID, PAD_ID, TINY_MODELS, UNK_ID
from tests.model.reference import HFReference


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_output_is_not_one_repeated_token(
    name: str, hf_reference: Callable[[str], HFReference]
) -> None:
    ref = hf_reference(name)
    for prompt in ((5, 6, 7), tuple(range(40, 57))):
        tokens, _ = ref.generate(prompt, 12)
        assert len(set(tokens)) >= 3, f"{name} collapsed to {tokens}"


def test_checkpoint_directory_and_tokenizer(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama-gqa")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    config = json.loads((path / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    tok = load_tokenizer(path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        PAD_ID,
        BOS_ID,
        EOS_ID,
        UNK_ID,
    )
    ids = tok("the paged attention design")["input_ids"]
    assert ids
    assert max(ids) < config["vocab_size"]
    assert tok.decode(ids) == "the paged attention design"
