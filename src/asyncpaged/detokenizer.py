"""Incremental detokenization with stop strings, and the stop-token check.

One :class:`IncrementalDetokenizer` per output sequence turns the token ids the model produces
into text deltas that are safe to stream:

* **Whole characters only.** A byte-level tokenizer can split one character over several tokens;
  decoding such a prefix yields U+FFFD. Text is taken from a window of ids that is decoded and
  diffed (vLLM's prefix/read offsets): tokens whose decoded text still ends in U+FFFD stay
  *pending* until a later token completes the character (or the sequence ends).

  ::

      ids:  [ .. context (~5 prompt ids) .. | out0 out1 out2 out3 out4 ]
                              ^prefix_offset         ^read_offset        ^len(ids)
      decode(ids[prefix_offset:read_offset]) = prefix_text    (already in the output text)
      decode(ids[prefix_offset:])            = prefix_text + new text of ids[read_offset:]

  Decoding from ``prefix_offset`` rather than ``read_offset`` keeps the tokenizer's
  start-of-text rules (SentencePiece dropping the leading space, WordLevel/WordPiece joining with
  spaces) from applying in the middle of the text.

  With a stock fast tokenizer the same window runs in Rust: ``tokenizers``' ``DecodeStream``
  (seeded with the context ids) keeps the offsets and decodes once per id, and the Python
  side only mirrors the offsets (2.1 -> 1.6 us per token). It refuses a window whose text
  does not extend its prefix text (a SentencePiece strip after a byte-fallback run); from that
  id on the Python windows take over, from the same offsets. A differential test checks that
  both give the same deltas, text and stop cuts.

  Where the decoder treats each token alone (byte-level: GPT-2, Llama 3, Qwen, whose tokens'
  bytes concatenate; WordPiece; none) a token adds a text of its own after the window (a
  byte-level token of whole UTF-8 characters, while nothing is pending; a joiner's token after
  one that is not skipped): a memo per tokenizer serves it without a decode (0.7 us per token,
  the stream 1.35), and the Rust stream is made again at the offsets when an id needs it. The
  memos and the plain-backend test are the module's functions below the class.

* **No text that is later cut.** While a stop string could still be completed, the last
  ``SamplingParams.output_text_buffer_length`` characters (longest stop string - 1) are held
  back; a stop string found later starts no earlier than the held-back text.

What the final text equals (``output_text`` once ``finished``), before any stop-string cut: the
text the output ids add after the prompt,
``decode(prompt_ids + output_ids)[len(decode(prompt_ids)):]``, decoding with the params'
``skip_special_tokens`` and ``clean_up_tokenization_spaces=False`` (as vLLM: cleanup such as
" ." -> "." would need text not generated yet). Token ids outside ``[0, len(tokenizer))`` add no
text. Consequences and the known exceptions:

* Byte-level BPE (GPT-2, Llama 3, Qwen): exactly ``decode(output_ids)``.
* Tokenizers that drop a separator at the start of a text (SentencePiece's leading "▁", the space
  WordLevel/WordPiece join tokens with): the first output token keeps its separator because the
  text continues the prompt, so the text may start with one space that ``decode(output_ids)``
  drops. vLLM does the same.
* Byte-fallback tokenizers (``<0xNN>`` tokens, Llama 2, Mistral), only for output that is not
  valid UTF-8: ``decode`` renders *every* byte token of an invalid run as U+FFFD, including bytes
  that were complete characters (e.g. ``<0x7A>`` "z") when generated and were already streamed;
  the text keeps those characters. Output that decodes without U+FFFD is reproduced exactly.
* A prompt that ends inside a multi-byte character: no prompt context is used (see
  ``__init__``), so the output decodes as on its own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import tokenizers.decoders

from asyncpaged.sampling_params import SamplingParams

# tokenizers' incremental decoder (0.21 on; seeded with ids since 0.22), where it has one
_DecodeStream: Any = getattr(tokenizers.decoders, "DecodeStream", None)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IncrementalDetokenizer", "check_stop_token"]

_CONTEXT_TOKENS = 5
"""Prompt ids decoded in front of the output (vLLM's initial incremental detokenization offset)."""

_MAX_CONTEXT_TOKENS = _CONTEXT_TOKENS + 3
"""UTF-8 characters are at most 4 bytes: 3 more ids reach the start of a split character."""


REPLACEMENT_CHAR = "\ufffd"  # what a decode of partial UTF-8 yields


_SINGLE_TOKEN_TEXTS: dict[tuple[int, bool], tuple[Any, dict[int, str]]] = {}


def single_token_texts(tokenizer: Any, skip_special_tokens: bool) -> dict[int, str]:
    """The memo of one-token decodes for a tokenizer (held with it, so its id stays its own)."""
    key = (id(tokenizer), skip_special_tokens)
    entry = _SINGLE_TOKEN_TEXTS.get(key)
    if entry is None or entry[0] is not tokenizer:
        if len(_SINGLE_TOKEN_TEXTS) >= 64:  # tokenizers come and go in tests: stay bounded
            _SINGLE_TOKEN_TEXTS.clear()
        entry = _SINGLE_TOKEN_TEXTS[key] = (tokenizer, {})
    return entry[1]


class WholeTokens:
    """Tokens whose text after a window is their own, for a plain fast tokenizer whose decoder
    treats each token alone: byte-level (GPT-2, Llama 3, Qwen; the tokens' bytes concatenate,
    so a token of whole UTF-8 characters adds exactly its text after a window that ends a
    character), WordPiece (each token but the first gets its space or loses its "##" prefix,
    and its cleanup runs per token) and none (tokens joined with spaces). Joiners' tokens
    (``joins``) add that text only where the window holds a token that is not skipped.
    SentencePiece's leading-space strip, byte fallback and the other decoders make a token's
    text depend on the tokens around it: no table.

    ``texts`` memoizes token id -> its text ("" where it has none of its own: not whole
    characters, an added or special token, no token). One per tokenizer, shared by every
    sequence whatever its ``skip_special_tokens`` (the added tokens it affects stay out)."""

    __slots__ = ("_backend", "_decoder", "added", "joins", "texts")

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._decoder = backend.decoder
        self.added = frozenset(backend.get_added_tokens_decoder())
        self.joins = not isinstance(self._decoder, tokenizers.decoders.ByteLevel)
        self.texts: dict[int, str] = {}

    @staticmethod
    def of(backend: Any) -> WholeTokens | None:
        if backend is None:
            return None
        decoder = backend.decoder
        if not (decoder is None or isinstance(decoder, _LOCAL_DECODERS)):
            return None
        entry = _WHOLE_TOKENS.get(id(backend))
        if entry is None or entry._backend is not backend:
            if len(_WHOLE_TOKENS) >= 64:  # tokenizers come and go in tests: stay bounded
                _WHOLE_TOKENS.clear()
            entry = _WHOLE_TOKENS[id(backend)] = WholeTokens(backend)
        return entry

    def text(self, token_id: int) -> str:
        """The token's own text (memoized), or ""."""
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self._text(token_id)
        return text

    def _text(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None or token_id in self.added:
            return ""
        if self._decoder is None:
            return " " + str(token)
        if self.joins:  # after a first token that adds nothing of its own
            return str(self._decoder.decode(["", token]))
        text = str(self._decoder.decode([token]))
        # Partial or invalid UTF-8 decodes to U+FFFD (a token spelling U+FFFD itself is left
        # to the window path too).
        return "" if REPLACEMENT_CHAR in text else text


_LOCAL_DECODERS = (tokenizers.decoders.ByteLevel, tokenizers.decoders.WordPiece)
_WHOLE_TOKENS: dict[int, WholeTokens] = {}


def plain_fast_backend(tokenizer: Any, decode_kwargs: dict[str, bool]) -> Any:
    """The Rust tokenizer when ``tokenizer.decode(ids, **decode_kwargs)`` is exactly its
    ``decode(ids, skip_special_tokens=...)``: a stock transformers fast tokenizer (neither
    ``decode`` nor ``_decode`` overridden), no cleanup and no other option. Else None.

    transformers' fast ``_decode`` calls the backend and then, only with
    ``clean_up_tokenization_spaces``, cleans up; skipping its Python wrapper (argument
    conversion, batching checks) halves the cost of a decode."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and set(decode_kwargs) == {"skip_special_tokens", "clean_up_tokenization_spaces"}
        and decode_kwargs["clean_up_tokenization_spaces"] is False
    )
    return tokenizer.backend_tokenizer if plain else None


def check_stop_token(
    token_id: int, params: SamplingParams, eos_token_id: int | None, num_generated: int
) -> tuple[Literal["stop"], int | None] | None:
    """Whether the token just generated ends its sequence: ``("stop", stop_reason)`` or ``None``.

    ``num_generated`` counts the sequence's output tokens including ``token_id``. Nothing stops
    while ``num_generated <= params.min_tokens``: ``min_tokens`` tokens come before EOS or a stop
    token id, which is the behaviour of vLLM's min-tokens logits processor. Then EOS stops with
    ``stop_reason=None`` unless ``params.ignore_eos``; a token in ``params.stop_token_ids`` stops
    with ``stop_reason=token_id`` (also when it is the EOS token and ``ignore_eos`` is set).
    ``max_tokens`` and the model length are the scheduler's business, not checked here.
    """
    if num_generated <= params.min_tokens:
        return None
    if eos_token_id is not None and token_id == eos_token_id and not params.ignore_eos:
        return ("stop", None)
    if token_id in params.stop_token_ids:
        return ("stop", token_id)
    return None


_SPACES_KWARG: dict[type, bool] = {}  # tokenizer class -> its _decode takes the keyword


def _takes_spaces_kwarg(tokenizer: object) -> bool:
    """Whether the tokenizer's ``_decode`` declares ``spaces_between_special_tokens``; memoized
    per class (a signature costs ~20 us, and a request builds a detokenizer per sequence)."""
    cls = type(tokenizer)
    if cls not in _SPACES_KWARG:
        decode, takes = getattr(tokenizer, "_decode", None), False
        if decode is not None:
            with contextlib.suppress(TypeError, ValueError):  # no signature to read
                takes = "spaces_between_special_tokens" in inspect.signature(decode).parameters
        _SPACES_KWARG[cls] = takes
    return _SPACES_KWARG[cls]


class IncrementalDetokenizer:
    """Detokenizes one output sequence incrementally and finds its stop strings.

    Feed every generated token id through :meth:`update` (or, for the id that ended the
    sequence as EOS / stop token, ``update(..., stop_terminated=True)``); call :meth:`finish`
    when the sequence ends for another reason (length, abort). Each call returns the newly
    released text; their concatenation is ``output_text``.

    Invariants:

    * ``self._ids`` is the context (at most 8 prompt ids) followed by the in-vocabulary output
      ids decoded so far; ``prefix_offset <= read_offset <= len(self._ids)``.
    * ``self._text`` is the text of ``self._ids[context_len:read_offset]`` (cut at a stop string
      once one is found); ``self._ids[read_offset:]`` is pending, its text not yet final.
    * ``self._text[:self._num_released]`` is everything returned so far; it never shrinks.
    * ``self._prefix_text`` is None or ``decode(self._ids[prefix_offset:read_offset])``;
      ``self._stream``, while set, holds the same ids and offsets (in Rust).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        """Take the last few prompt ids as decoding context; no text is produced yet.

        If the prompt's text ends in an incomplete character (the prompt ends mid-way through a
        multi-byte character), no context is used: the output then decodes as it would on its
        own, since a prompt character completed by output bytes cannot be split between prompt
        and output text.
        """
        self._tokenizer = tokenizer
        self._params = params
        self._vocab_size = len(tokenizer)
        self._decode_kwargs: dict[str, bool] = {
            "skip_special_tokens": params.skip_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        # transformers 5 ignores spaces_between_special_tokens except in a few tokenizers
        # (wav2vec2); pass it only where it is a declared parameter, as some reject unknown ones.
        if _takes_spaces_kwarg(tokenizer):
            self._decode_kwargs["spaces_between_special_tokens"] = (
                params.spaces_between_special_tokens
            )
        self._backend = plain_fast_backend(tokenizer, self._decode_kwargs)
        # decode([id]) memo, shared by every sequence of this tokenizer and skip flag
        self._single = single_token_texts(tokenizer, params.skip_special_tokens)
        context, prefix_text = self._choose_context(prompt_token_ids)
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = prefix_text  # None: not decoded since the offsets moved
        # The same window algorithm in Rust (one call per id), where the backend is plain;
        # made when an id needs it (a token with a text of its own takes the table below).
        self._stream: Any = None
        self._streaming = self._backend is not None and _DecodeStream is not None
        # Tokens whose text after a window is their own (memoized per tokenizer), if any
        self._whole = WholeTokens.of(self._backend)
        # The window ids[prefix_offset:read_offset] holds a token not skipped (a joiner's
        # next token is not the first then)
        self._after_text = bool(prefix_text)
        self._text = ""
        self._num_released = 0
        self._output_token_ids: list[int] = []
        self._stop_search_from = 0  # stop strings must end after this text index
        self._stop_reason: str | None = None
        self._finished = False
        self._has_stops = bool(params.stop)
        self._held_back = params.output_text_buffer_length  # chars kept while not finished

    @property
    def output_text(self) -> str:
        """The text released so far: the concatenation of all returned deltas."""
        return self._text[: self._num_released]

    @property
    def output_token_ids(self) -> list[int]:
        """The output ids consumed so far (ids after a completed stop string are not)."""
        return list(self._output_token_ids)

    @property
    def finished(self) -> bool:
        """True after a stop string was found, ``update(stop_terminated=True)`` or ``finish()``."""
        return self._finished

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the sequence, if one did."""
        return self._stop_reason

    def update(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False) -> str:
        """Consume newly generated ids; return the text released by them.

        Stops at the first token that completes a stop string (the earliest to end; of two
        ending together, the one that starts first): later ids are ignored, the text is cut
        before the stop string (after it with ``include_stop_str_in_output``) and the sequence
        is finished. Stop strings are only looked for once more than ``min_tokens`` ids were
        consumed; they may start in earlier text.

        ``stop_terminated=True`` says the last id ended the sequence (EOS or a stop token id):
        it is recorded, its text is added only with ``include_stop_str_in_output``, and the
        sequence is finished as by :meth:`finish`. Must not be called once finished.
        """
        assert not self._finished, "update() on a finished IncrementalDetokenizer"
        has_stops = self._has_stops
        if len(new_token_ids) == 1 and not (stop_terminated or has_stops):  # a decode's token
            token_id = new_token_ids[0]
            self._output_token_ids.append(token_id)
            if 0 <= token_id < self._vocab_size:
                self._ids.append(token_id)
                self._advance()
            return self._release()
        last = len(new_token_ids) - 1 if stop_terminated else -1
        for i, token_id in enumerate(new_token_ids):
            self._output_token_ids.append(token_id)
            if i == last and not self._params.include_stop_str_in_output:
                break  # the stop token adds no text
            if 0 <= token_id < self._vocab_size:
                self._ids.append(token_id)
                self._advance()
            if has_stops and self._check_stop_strings():
                return self._release()
        if stop_terminated:
            return self.finish()
        return self._release()

    def finish(self) -> str:
        """End the sequence; return all text still held back or pending.

        Pending ids are decoded as they are, so an incomplete character at the end becomes
        U+FFFD exactly as ``tokenizer.decode`` renders it; that text can still complete a stop
        string. Calling it again returns "".
        """
        if self._finished:
            return ""
        if self._read_offset < len(self._ids):
            new_text = self._decode(self._ids[self._prefix_offset :])
            prefix_text = self._window_prefix_text()
            if len(new_text) > len(prefix_text):
                self._text += new_text[len(prefix_text) :]
            self._read_offset = len(self._ids)
            self._check_stop_strings()
        self._finished = True
        return self._release()

    def _choose_context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        """The prompt's last ids whose text does not end in an incomplete character, and it.

        Tries 5 ids, then up to 3 more (a window starting inside a character that byte-fallback
        tokens spell out decodes to U+FFFD throughout), then fewer; else no context.
        """
        prompt_ids = [i for i in prompt_token_ids[-_MAX_CONTEXT_TOKENS:] if self._in_vocab(i)]
        lengths = [
            *range(_CONTEXT_TOKENS, _MAX_CONTEXT_TOKENS + 1),
            *range(_CONTEXT_TOKENS - 1, 0, -1),
        ]
        for length in lengths:
            if length > len(prompt_ids):
                continue
            context = prompt_ids[-length:]
            text = self._decode(context)
            if not text.endswith(REPLACEMENT_CHAR):
                return context, text
        return [], ""

    def _in_vocab(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:  # the common window: one token (a pure function of it, memoized)
            text = self._single.get(ids[0])
            if text is None:
                text = self._single[ids[0]] = self._decode_uncached(ids)
            return text
        return self._decode_uncached(ids)

    def _decode_uncached(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:  # the same call transformers would make, without its wrapper
            backend_text: str = self._backend.decode(
                ids, skip_special_tokens=self._decode_kwargs["skip_special_tokens"]
            )
            return backend_text
        text = self._tokenizer.decode(ids, **self._decode_kwargs)
        assert isinstance(text, str), f"tokenizer.decode returned {type(text).__name__}"
        return text

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _new_stream(self) -> Any:
        """A DecodeStream at the current offsets (``ids[prefix_offset:read_offset]`` decoded,
        nothing pending), or None where this ``tokenizers`` takes no ids."""
        with contextlib.suppress(TypeError):
            self._stream = _DecodeStream(
                ids=self._ids[self._prefix_offset : self._read_offset],
                skip_special_tokens=self._params.skip_special_tokens,
            )
        return self._stream

    def _advance(self) -> None:
        """Move the text of ``ids[read_offset:]`` into ``_text`` if it is complete (the last id
        was just appended to ``_ids``)."""
        whole = self._whole
        if (
            whole is not None and self._read_offset == len(self._ids) - 1
            and (self._after_text or not whole.joins)
        ):  # fmt: skip
            # Nothing pending (a byte-level window ends a character): a token with a text of
            # its own adds exactly that (WholeTokens). The Rust stream, stepped past, is
            # made again when an id needs the window.
            text = whole.texts.get(self._ids[-1]) or whole.text(self._ids[-1])
            if text:
                self._text += text
                self._prefix_offset = self._read_offset
                self._read_offset += 1
                self._prefix_text = None
                self._stream = None
                return
        stream = self._stream
        if stream is None and self._streaming:  # first made, or a token stepped past it
            assert self._read_offset == len(self._ids) - 1, "made with nothing pending"
            stream = self._new_stream()
            self._streaming = stream is not None
        if stream is not None:
            try:
                chunk = stream.step(self._backend, self._ids[-1])
            except Exception:  # e.g. a window whose text does not extend its prefix text
                self._stream = None  # its state is off by this id now: the Python path goes on
                self._streaming = False
            else:
                if chunk is not None:
                    self._text += chunk
                    self._prefix_offset = self._read_offset
                    self._read_offset = len(self._ids)
                    self._prefix_text = None
                    self._after_text = True  # the chunk's ids: one is not skipped
                return
        new_text = self._decode(self._ids[self._prefix_offset :])
        prefix_text = self._window_prefix_text()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # No new text yet, or it may end in a partial character: wait for more ids.
            return
        self._text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._after_text = True  # the new text's ids: one is not skipped

    def _check_stop_strings(self) -> bool:
        """Find a stop string ending after ``_stop_search_from``; if found, cut the text, finish
        and return True."""
        search_from, self._stop_search_from = self._stop_search_from, len(self._text)
        stop = self._params.stop
        if not stop or len(self._output_token_ids) <= self._params.min_tokens:
            return False
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in stop:
            start = self._text.find(stop_str, max(0, search_from - len(stop_str) + 1))
            if start != -1:
                candidate = (start + len(stop_str), start, stop_str)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return False
        end, start, stop_str = best
        cut = end if self._params.include_stop_str_in_output else start
        assert cut >= self._num_released, (
            f"stop string {stop_str!r} cuts released text: cut at {cut}, "
            f"released {self._num_released} chars"
        )
        self._text = self._text[:cut]
        self._stop_reason = stop_str
        self._finished = True
        return True

    def _release(self) -> str:
        """Return the text that can no longer be cut, and mark it released."""
        limit = len(self._text)
        if not self._finished:
            limit -= self._held_back
        if limit <= self._num_released:
            return ""
        delta = self._text[self._num_released : limit]
        self._num_released = limit
        return delta
