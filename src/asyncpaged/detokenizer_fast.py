"""The fast paths of :class:`~asyncpaged.detokenizer.IncrementalDetokenizer`, per tokenizer.

* :func:`plain_fast_backend`: the Rust tokenizer behind a stock transformers fast tokenizer,
  decoded directly (skipping transformers' Python wrapper) and stepped by ``DecodeStream``.
* :func:`single_token_texts`: a memo of one-token decodes (the common window), shared by every
  sequence of a tokenizer and ``skip_special_tokens`` flag.
* :class:`WholeTokens`: the texts of tokens that add a text of their own after a window, for
  decoders that treat each token alone (byte-level, WordPiece, none), served without a decode.

The memos are module-level, keyed by the tokenizer's (or backend's) ``id`` and holding it, and
cleared when they reach 64 entries. Only ``detokenizer.py`` uses this module.
"""

from __future__ import annotations

from typing import Any

import tokenizers.decoders

REPLACEMENT_CHAR = "\ufffd"  # what a decode of partial UTF-8 yields; detokenizer.py uses it too


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
