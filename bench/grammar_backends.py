"""Grammar backends side by side: xgrammar (the engine's), llguidance and outlines-core.

Usage: ``python bench/grammar_backends.py [--repeats 5] [--json out.json]`` (llguidance and
outlines-core are not dependencies: ``pip install llguidance outlines-core``; a backend that is
not installed is skipped).

On the built-in model's tokenizer (byte-level BPE, 3072 tokens), or with ``--vocab-size N`` a
byte-level BPE of N tokens trained on this Python's standard library sources (a few seconds; the
mask work grows with the vocabulary), for each JSON schema (the
``bench structured`` schema with long fixed keys, and the tests' small schema), each backend:

* **setup**: its tokenizer / vocabulary object from the Hugging Face tokenizer (once per engine);
* **compile**: the schema to a ready matcher, cold (no compile cache), including the first
  bitmask, since llguidance and outlines-core do part of their work lazily on it;
* **mask**: per-token time to fill the next-token bitmask ([1, ceil(V / 32)] int32, the layout
  all three share) while the matcher walks the tokens of a valid instance (the tokenizer's own
  split of it), then accepts each token; the median over tokens, then over repeats.

Every backend must accept every token of the instance (checked). Times are medians of
``--repeats`` interleaved rounds, with the min-max spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncpaged.tools.bench_structured import SCHEMA as BENCH_SCHEMA

SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob", "carl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
INSTANCES = {
    "bench": {
        "statement_kind_of_the_python_language": "compound",
        "introduced_in_python_version_number": 3,
        "related_keywords_in_the_grammar": ["with", "yield"],
    },
    "small": {"name": "carl", "age": 42, "tags": ["bb", "a"]},
}
SCHEMAS = {"bench": BENCH_SCHEMA, "small": SMALL_SCHEMA}

# A backend: setup(tokenizer) -> context; compile(context, schema) -> walker, where
# walker.fill(bitmask) fills the next-token bitmask and walker.accept(token) -> bool.
Backend = tuple[Callable[[Any], Any], Callable[[Any, dict[str, Any]], Any]]


class _Xgrammar:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))


def _xgrammar() -> Backend:
    import xgrammar as xgr

    def setup(tokenizer: Any) -> Any:
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
        )

    def compile_schema(info: Any, schema: dict[str, Any]) -> Any:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return _Xgrammar(xgr.GrammarMatcher(compiled))

    return setup, compile_schema


class _Llguidance:
    def __init__(self, matcher: Any) -> None:
        import llguidance.torch as llt

        self.matcher = matcher
        self._fill = llt.fill_next_token_bitmask

    def fill(self, bitmask: torch.Tensor) -> None:
        self._fill(self.matcher, bitmask, 0)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token))


def _llguidance() -> Backend:
    import llguidance
    import llguidance.hf

    def setup(tokenizer: Any) -> Any:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def compile_schema(lltok: Any, schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return _Llguidance(matcher)

    return setup, compile_schema


class _Outlines:
    def __init__(self, guide: Any) -> None:
        from outlines_core.kernels.torch import fill_next_token_bitmask

        self.guide = guide
        self._fill = fill_next_token_bitmask

    def fill(self, bitmask: torch.Tensor) -> None:
        self._fill(self.guide, bitmask)

    def accept(self, token: int) -> bool:
        try:
            self.guide.advance(token)
        except ValueError:
            return False
        return True


def _outlines() -> Backend:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def setup(tokenizer: Any) -> Any:
        # outlines-core reads a vocabulary of raw token bytes: undo the byte-level alphabet
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        for token_id in range(len(tokenizer)):
            if token_id == tokenizer.eos_token_id:
                continue
            text = tokenizer.convert_ids_to_tokens(token_id)
            if not all(c in byte_of for c in text):
                continue  # a special token: never part of JSON
            tokens.setdefault(bytes(byte_of[c] for c in text), []).append(token_id)
        return Vocabulary(tokenizer.eos_token_id, tokens)

    def compile_schema(vocabulary: Any, schema: dict[str, Any]) -> Any:
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        return _Outlines(Guide(Index(regex, vocabulary)))

    return setup, compile_schema


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character BPE vocabularies store it as."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(extra))]
    return {b: chr(c) for b, c in zip(printable + extra, chars, strict=True)}


def _tokenizer(vocab_size: int) -> Any:
    """The built-in model's tokenizer, or a byte-level BPE of ``vocab_size`` tokens trained on
    the standard library's sources (GPT-2's pre-tokenizer and alphabet)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not vocab_size:
        from asyncpaged.tools.demo import default_model

        return AutoTokenizer.from_pretrained(default_model())
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(f) for f in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(files, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    ))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>")


def _measure(
    name: str, backend: Backend, context: Any, schema: str, tokens: list[int]
) -> dict[str, float]:
    _, compile_schema = backend
    vocab = len(context[1])
    bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
    began = time.perf_counter()
    walker = compile_schema(context[0], SCHEMAS[schema])
    walker.fill(bitmask)
    compile_s = time.perf_counter() - began
    assert walker.accept(tokens[0]), f"{name}, {schema}: first token refused"
    mask_s = []
    for token in tokens[1:]:
        began = time.perf_counter()
        walker.fill(bitmask)
        mask_s.append(time.perf_counter() - began)
        allowed = bool((bitmask[0, token // 32] >> (token % 32)) & 1)
        assert allowed, f"{name}, {schema}: token {token} masked out"
        assert walker.accept(token), f"{name}, {schema}: token {token} refused"
    return {"compile_ms": compile_s * 1e3, "mask_us": statistics.median(mask_s) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--vocab-size", type=int, default=0, help="0: the built-in tokenizer; N: a trained BPE"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = _tokenizer(args.vocab_size)
    print(f"vocabulary: {len(tokenizer)} tokens")
    backends: dict[str, Backend] = {}
    for name, make in (("xgrammar", _xgrammar), ("llguidance", _llguidance),
                       ("outlines-core", _outlines)):  # fmt: skip
        try:
            backends[name] = make()
        except ImportError:
            print(f"{name}: not installed, skipped")
    contexts: dict[str, Any] = {}
    setup_ms: dict[str, float] = {}
    for name, (setup, _) in backends.items():
        began = time.perf_counter()
        contexts[name] = (setup(tokenizer), tokenizer)
        setup_ms[name] = (time.perf_counter() - began) * 1e3
    texts = {k: json.dumps(v) for k, v in INSTANCES.items()}  # ", " and ": " separators
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # interleaved rounds
        for schema, text in texts.items():
            tokens = tokenizer.encode(text, add_special_tokens=False)
            for name, backend in backends.items():
                got = _measure(name, backend, contexts[name], schema, tokens)
                samples.setdefault((name, schema), []).append(got)
    rows = []
    print(f"{'backend':14s} {'schema':6s} {'setup ms':>9s} {'compile ms (min-max)':>22s} "
          f"{'mask us/token (min-max)':>24s}")  # fmt: skip
    for (name, schema), runs in samples.items():
        row: dict[str, Any] = {"backend": name, "schema": schema, "setup_ms": setup_ms[name]}
        for key in ("compile_ms", "mask_us"):
            values = [r[key] for r in runs]
            row[key] = statistics.median(values)
            row[f"{key}_spread"] = (min(values), max(values))
        rows.append(row)
        c, m = row["compile_ms_spread"], row["mask_us_spread"]
        print(
            f"{name:14s} {schema:6s} {setup_ms[name]:9.1f} {row['compile_ms']:9.2f} "
            f"({c[0]:.2f}-{c[1]:.2f}) {row['mask_us']:11.1f} ({m[0]:.1f}-{m[1]:.1f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab_size": len(tokenizer), "rows": rows,
                       "tokens": {k: len(tokenizer.encode(t)) for k, t in texts.items()}},
                      f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
