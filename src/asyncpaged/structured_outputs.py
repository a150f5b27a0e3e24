"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a
grammar (vLLM's ``StructuredOutputsParams``), on xgrammar.

Why xgrammar: it is made for this (vLLM's and SGLang's default backend), runs on CPU, compiles a
schema in milliseconds (8.7 ms for a two-field object on the tiny tokenizer, measured) and fills
a whole vocabulary's bitmask per step in C++, reads Hugging Face tokenizers of every vocabulary
type (byte-level BPE, SentencePiece, tiktoken), and offers jump-forward strings and matcher forks.
llguidance is as fast per token but adds a Rust toolchain's wheels to the install; outlines-core
compiles regex automata ahead of time, slow for large schemas. It is the ``structured`` extra.

Per request the engine compiles the constraint once, off the event loop (intake's worker thread,
cached by constraint and tokenizer); per sequence it keeps a ``GrammarMatcher`` (n > 1 / best_of:
one each), fills that sequence's next-token bitmask when a step samples it, and feeds it the
sampled tokens. The matcher follows tokens, not KV blocks, so preemption by swap or by recompute
leaves it as it was. The sampler sets every token outside the bitmask to -inf before the
penalties (the reported logprobs stay the raw ones); constrained rows never take the screened LM
heads. When the grammar is complete only the stop tokens remain allowed, so a sequence ends with
finish reason "stop" unless ``max_tokens`` comes first.
"""

from __future__ import annotations

import importlib.util
import json as json_module
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncpaged.errors import InvalidRequestError

__all__ = ["GrammarBackend", "StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CACHED = 256  # compiled constraints kept per engine
EXTRA_HINT = "structured outputs need xgrammar: pip install 'asyncpaged[structured]'"


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): ``json`` (a JSON schema, as a dict or a JSON
    string; stored as JSON text, key order kept), ``regex``, ``choice`` (a list of strings: the
    output is one of them), ``grammar`` (EBNF / GBNF, xgrammar's dialect) or
    ``json_object=True`` (any JSON object). ``disable_any_whitespace`` keeps a schema's JSON
    compact."""

    json: str | None
    regex: str | None
    choice: tuple[str, ...] | None
    grammar: str | None
    json_object: bool | None
    disable_any_whitespace: bool

    def __init__(
        self,
        *,
        json: str | Mapping[str, Any] | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        disable_any_whitespace: bool = False,
    ) -> None:
        given = [k for k, v in (("json", json), ("regex", regex), ("choice", choice),
                                ("grammar", grammar), ("json_object", json_object))
                 if v not in (None, False)]  # fmt: skip
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of {list(_KINDS)}, got {given or 'none'}."
            )
        if json is not None and not isinstance(json, str):
            if not isinstance(json, Mapping):
                raise InvalidRequestError("json must be a JSON schema: a dict or a JSON string.")
            json = json_module.dumps(json)  # key order kept: properties generate in it
        for name, value in (("json", json), ("regex", regex), ("grammar", grammar)):
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string.")
        if choice is not None:
            if isinstance(choice, str) or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError("choice must be a list of non-empty strings.")
            if not choice:
                raise InvalidRequestError("choice must not be empty.")
            choice = tuple(choice)
        if not isinstance(disable_any_whitespace, bool):
            raise InvalidRequestError("disable_any_whitespace must be a bool.")
        values: dict[str, object] = {
            "json": json, "regex": regex, "choice": choice, "grammar": grammar,
            "json_object": True if json_object else None,
            "disable_any_whitespace": disable_any_whitespace,
        }  # fmt: skip
        for field_name, field_value in values.items():
            object.__setattr__(self, field_name, field_value)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


def is_available() -> bool:
    """Whether xgrammar is installed (the ``structured`` extra)."""
    return importlib.util.find_spec("xgrammar") is not None


class GrammarBackend:
    """One engine's grammar compiler: xgrammar's tokenizer info (built on first use, in the
    caller's thread) and a cache of compiled constraints.

    Invariants: every compiled grammar and matcher belongs to ``tokenizer`` with ``vocab_size``
    logits columns; ``compile`` is safe to call from one worker thread at a time (intake's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._compiled: dict[StructuredOutputsParams, Any] = {}  # at most MAX_CACHED

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None,
                )  # fmt: skip
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached); InvalidRequestError for a bad schema, regex or
        grammar, naming what the compiler said."""
        if not is_available():
            raise InvalidRequestError(EXTRA_HINT)
        compiled = self._compiled.get(params)
        if compiled is None:
            compiled = _compile(self._xgr_compiler(), params)
            if len(self._compiled) >= MAX_CACHED:
                self._compiled.pop(next(iter(self._compiled)))  # the oldest
            self._compiled[params] = compiled
        return compiled

    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def next_token_bitmask(self, matcher: Any) -> torch.Tensor:
        """[ceil(V / 32)] int32: bit ``v % 32`` of word ``v // 32`` set iff token v may follow."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bitmask[0]


def _compile(compiler: Any, params: StructuredOutputsParams) -> Any:
    compact = params.disable_any_whitespace
    try:
        match params.kind:
            case "json":
                return compiler.compile_json_schema(params.json, any_whitespace=not compact)
            case "regex":
                return compiler.compile_regex(params.regex)
            case "choice":
                choices = " | ".join(json_module.dumps(c) for c in params.choice or ())
                return compiler.compile_grammar(f"root ::= {choices}")
            case "grammar":
                return compiler.compile_grammar(params.grammar)
            case _:  # json_object: any JSON object (xgrammar's builtin grammar takes any value)
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not compact
                )
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(f"invalid structured output {params.kind}: {first}") from exc


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 bitmasks -> [..., vocab_size] bool: which tokens each allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32)[..., None] >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()
