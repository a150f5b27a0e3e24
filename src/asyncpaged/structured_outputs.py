"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a
grammar (vLLM's ``StructuredOutputsParams``), on xgrammar.

Why xgrammar: it is made for this (vLLM's and SGLang's default backend), runs on CPU, reads
Hugging Face tokenizers of every vocabulary type (byte-level BPE, SentencePiece, tiktoken), fills
a bitmask for a whole batch in one C++ call and offers jump-forward tokens and matcher forks.
Measured against the two alternatives (``bench/grammar_backends.py``, one thread, docs/benchmarks.md
"Grammar backends"; built-in 3072-token vocabulary / a 32k byte-level BPE): xgrammar compiles a
schema in 1.3 / 1.4-3.4 ms and fills a mask in 1.2 / 1.4 us per token; llguidance compiles
lazily (under 1 ms, but 2.5-3.8 s for the first grammar of a process) and fills a mask in 14-20
us, 10x xgrammar's, with only fast tokenizers; outlines-core fills as fast (1.5 us, a lookup
in an index built ahead of time) but builds that index in 25-71 ms at 32k, needs the vocabulary
as raw bytes (or a hub id), takes JSON only as a regex and has no jump-forward. It is the
``structured`` extra.

Per request the engine compiles the constraint once, off the event loop (intake's worker thread,
cached by constraint and tokenizer); per sequence it keeps a ``GrammarMatcher`` (n > 1 / best_of:
one each). Each step fills the bitmasks of all its constrained rows in one batch call into one
buffer (``next_token_bitmasks``; each row's ``SamplingOptions.token_bitmask`` is a view of it)
and feeds the matchers the sampled tokens afterwards. The matcher follows tokens, not KV blocks,
so preemption by swap or by recompute leaves it as it was. The sampler sets every token outside
the bitmask to -inf before the penalties (the reported logprobs stay the raw ones); greedy rows
with no other control keep the screened LM heads, which rank the allowed tokens only
(``allowed_tokens``; the screens' bound argument holds over any subset of the vocabulary). When
the grammar is complete only the stop tokens remain allowed, so a sequence ends with finish
reason "stop" unless ``max_tokens`` comes first.

Jump-forward (SGLang's compressed FSM, ``EngineConfig.structured_outputs_jump_forward``): after
a sampled token the scheduler appends ``jump_forward_tokens`` (what the grammar forces next,
accepted by the matcher) to the sequence as uncomputed tokens, so the next step computes them
like a prefill chunk, and one forward replaces a sampling step per forced token.
"""

from __future__ import annotations

import importlib.util
import json as json_module
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncpaged.errors import InvalidRequestError

__all__ = ["GrammarBackend", "StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CACHED = 256  # compiled constraints kept per engine
EXTRA_HINT = "structured outputs need xgrammar: pip install 'asyncpaged[structured]'"


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): ``json`` (a JSON schema, as a dict or a JSON
    string; stored as JSON text, key order kept), ``regex``, ``choice`` (a list of strings: the
    output is one of them), ``grammar`` (EBNF / GBNF, xgrammar's dialect) or
    ``json_object=True`` (any JSON object) or ``structural_tag`` (xgrammar's structural tag, as
    a dict or JSON text: free text with tagged parts, such as tool calls, whose content follows
    a schema; the engine builds these for ``tool_choice``). ``disable_any_whitespace`` keeps a
    schema's JSON compact."""

    json: str | None
    regex: str | None
    choice: tuple[str, ...] | None
    grammar: str | None
    json_object: bool | None
    structural_tag: str | None
    disable_any_whitespace: bool

    def __init__(
        self,
        *,
        json: str | Mapping[str, Any] | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        structural_tag: str | Mapping[str, Any] | None = None,
        disable_any_whitespace: bool = False,
    ) -> None:
        given = [k for k, v in (("json", json), ("regex", regex), ("choice", choice),
                                ("grammar", grammar), ("json_object", json_object),
                                ("structural_tag", structural_tag))
                 if v not in (None, False)]  # fmt: skip
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of {list(_KINDS)}, got {given or 'none'}."
            )
        if json is not None and not isinstance(json, str):
            if not isinstance(json, Mapping):
                raise InvalidRequestError("json must be a JSON schema: a dict or a JSON string.")
            json = json_module.dumps(json)  # key order kept: properties generate in it
        if structural_tag is not None and not isinstance(structural_tag, str):
            if not isinstance(structural_tag, Mapping):
                raise InvalidRequestError("structural_tag must be a dict or a JSON string.")
            structural_tag = json_module.dumps(structural_tag)
        for name, value in (("json", json), ("regex", regex), ("grammar", grammar),
                            ("structural_tag", structural_tag)):  # fmt: skip
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
            "json_object": True if json_object else None, "structural_tag": structural_tag,
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

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        jump_forward: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward  # EngineConfig.structured_outputs_jump_forward
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made on first use
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

    def next_token_bitmasks(self, matchers: Sequence[Any]) -> torch.Tensor:
        """[len(matchers), ceil(V / 32)] int32: every matcher's bitmask, filled in one call
        into one new buffer (a step's rows are views of it; a buffer per step, never reused,
        because the executor reads it while the next step is planned). A grammar that has
        ended (its stop token accepted) while the output goes on (``ignore_eos``) constrains
        nothing more, as in vLLM: its row allows every token."""
        import xgrammar as xgr

        bitmasks = torch.empty(len(matchers), -(-self.vocab_size // 32), dtype=torch.int32)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if len(live) == len(matchers):  # every row is filled: no all-ones start needed
            self._batch.batch_fill_next_token_bitmask(list(matchers), bitmasks)
        else:
            bitmasks.fill_(-1)
            if live:
                self._batch.batch_fill_next_token_bitmask(
                    [matchers[i] for i in live], bitmasks, live
                )
        return bitmasks

    def jump_forward_tokens(self, matcher: Any) -> list[int]:
        """Jump-forward: the tokens the grammar forces next (the only continuation, such as a
        schema's keys and punctuation), accepted by ``matcher``; empty when nothing is forced.

        xgrammar splits the forced string into the longest vocabulary tokens and leaves out a
        last token that is a strict prefix of a longer one (a sampled token may still extend
        it); each is then fed to the matcher and the first it rejects ends the jump, so every
        token returned is one the grammar allowed. They need not be how the model's tokenizer
        would split that text (SGLang retokenizes the tail; this does not): the text is the
        grammar's either way."""
        if matcher.is_terminated():
            return []
        accepted: list[int] = []
        for token in matcher.find_jump_forward_tokens():
            if not matcher.accept_token(token):
                break
            accepted.append(int(token))
        return accepted


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
            case "structural_tag":
                return compiler.compile_structural_tag(params.structural_tag)
            case _:  # json_object: any JSON object (xgrammar's builtin grammar takes any value)
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not compact
                )
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(f"invalid structured output {params.kind}: {first}") from exc


_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8)  # [256, 8]


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 bitmasks -> [..., vocab_size] bool: which tokens each allows.

    Little-endian hosts read each word as 4 bytes (byte b holds tokens 8b .. 8b + 7) and look
    the bytes up in a 256 x 8 table: 8x faster than shifting 32 bits out at a 32k vocabulary.
    """
    bitmask = bitmask.to(torch.int32)
    if sys.byteorder != "little":
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask[..., None] >> shifts) & 1  # [..., W, 32]
        return bits.flatten(-2)[..., :vocab_size].bool()
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [..., 4W]
    table = _BYTE_BITS.to(bitmask.device)
    bits = torch.nn.functional.embedding(as_bytes, table)  # [..., 4W, 8]
    return bits.flatten(-2)[..., :vocab_size].bool()


_BYTE_BIAS = torch.zeros(256, 8).masked_fill_(_BYTE_BITS == 0, float("-inf"))  # [256, 8]


def grammar_mask_bias(
    bitmasks: Sequence[torch.Tensor | None], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Rows' bitmasks ([W] int32 each, None: no grammar) -> [N, vocab_size] float32: 0 where a
    token is allowed, -inf where not (all 0 for an unconstrained row), for the screened LM
    heads to add to their scores; None when no row has a bitmask. Decoded through a byte table
    (little-endian hosts) like ``bitmask_to_allowed``."""
    masked = [r for r, b in enumerate(bitmasks) if b is not None]
    if not masked:
        return None
    stacked = torch.stack([bitmasks[r] for r in masked]).to(device, torch.int32)  # type: ignore[misc]
    if sys.byteorder == "little":
        as_bytes = stacked.contiguous().view(torch.uint8).long()  # [R, 4W]
        rows = torch.nn.functional.embedding(as_bytes, _BYTE_BIAS.to(device)).flatten(-2)
        rows = rows[:, :vocab_size]
    else:
        allowed = bitmask_to_allowed(stacked, vocab_size)
        rows = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))
    if len(masked) == len(bitmasks):
        return rows.contiguous()
    bias = torch.zeros(len(bitmasks), vocab_size, device=device)
    bias[torch.tensor(masked, dtype=torch.int64, device=device)] = rows
    return bias
