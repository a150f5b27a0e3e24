"""The benchmark issue's reference workload, defined once for every ``asyncpaged bench`` mode.

A random Llama checkpoint (hidden 512, intermediate 1376, 6 layers, 8 heads, 2 KV heads, vocab
32000, float32, ``initializer_range`` 0.05, ``torch.manual_seed(0)``) saved as a real HF directory
with a word-level tokenizer over the whole vocabulary (so every id detokenizes), and 64 requests
with prompt lengths uniform in 32-256 and ``max_tokens`` uniform in 64-128 drawn from
``random.Random(seed)``; prompt ids are uniform over ``[4, vocab)``. Greedy, EOS ignored.

``--quick`` shapes (a smaller model and fewer, shorter requests) exist for tests and smoke runs;
they are never reported as the reference numbers. ``prompt_lens`` / ``output_lens``
(``bench throughput --prompt-lens`` / ``--output-lens``) draw the lengths from other ranges on the
same model, e.g. long prompts for a KV-bound run; the description gives the lengths drawn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REFERENCE_MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "initializer_range": 0.05,
    "max_position_embeddings": 1024,
}
QUICK_MODEL: dict[str, Any] = {
    **REFERENCE_MODEL,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 2000,
}
NUM_SPECIAL = 4  # <pad> <s> </s> <unk>: prompt ids start after them


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """A seeded list of requests: prompt token ids and how many tokens each generates."""

    name: str
    model_config: dict[str, Any] = field(repr=False)
    prompts: tuple[tuple[int, ...], ...] = field(repr=False)
    max_tokens: tuple[int, ...] = field(repr=False)
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        return (
            f"{self.name}: {self.num_requests} requests, prompts {min(lens)}-{max(lens)} "
            f"(mean {sum(lens) / len(lens):.0f}), outputs {min(self.max_tokens)}-"
            f"{max(self.max_tokens)} ({self.output_tokens} tokens), greedy, EOS ignored"
        )


def make_workload(
    *,
    quick: bool = False,
    num_requests: int | None = None,
    seed: int = 0,
    prompt_lens: tuple[int, int] | None = None,
    output_lens: tuple[int, int] | None = None,
) -> Workload:
    """The reference workload (or the quick one): 64 requests, prompts 32-256, outputs 64-128;
    ``prompt_lens`` / ``output_lens`` (inclusive ranges) replace the lengths' ranges."""
    model = QUICK_MODEL if quick else REFERENCE_MODEL
    n = num_requests if num_requests is not None else (8 if quick else 64)
    prompt_range, output_range = ((8, 40), (8, 16)) if quick else ((32, 256), (64, 128))
    prompt_range, output_range = prompt_lens or prompt_range, output_lens or output_range
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        prompts.append(
            tuple(rng.randrange(NUM_SPECIAL, model["vocab_size"]) for _ in range(length))
        )
        outputs.append(rng.randint(*output_range))
    return Workload(
        name="quick" if quick else "reference",
        model_config=dict(model),
        prompts=tuple(prompts),
        max_tokens=tuple(outputs),
        seed=seed,
    )


def build_checkpoint(workload: Workload, directory: Path) -> Path:
    """Save the workload's random Llama (seed 0) and a word-level tokenizer as an HF directory.

    Idempotent: a directory that already holds this exact config is reused.
    """
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / "asyncpaged-bench.json"
    if marker.is_file() and json.loads(marker.read_text()) == workload.model_config:
        return directory
    config = LlamaConfig(**workload.model_config, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # float32 by default
    model.save_pretrained(str(directory))
    build_word_tokenizer(workload.model_config["vocab_size"]).save_pretrained(str(directory))
    marker.write_text(json.dumps(workload.model_config))
    return directory


def build_word_tokenizer(vocab_size: int) -> Any:
    """A tokenizer whose vocabulary is ``<pad> <s> </s> <unk>`` then ``w4 .. w{vocab-1}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from asyncpaged.testing.tiny_models import SPECIAL_TOKENS, as_transformers_tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(NUM_SPECIAL, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return as_transformers_tokenizer(tok)
