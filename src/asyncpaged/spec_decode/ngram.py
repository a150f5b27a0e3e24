"""Prompt lookup (n-gram) proposals: copy what followed an earlier occurrence of the suffix.

vLLM's rule (``NgramProposer``): among the suffixes of the context of ``prompt_lookup_min`` to
``prompt_lookup_max`` tokens, take the longest that also occurs earlier, at its *earliest*
occurrence, and propose the up to ``k`` tokens that followed it (fewer when the context ends
first; an occurrence may overlap the suffix itself, but at least one token follows it)::

    context   a b c d x b c d y b c d        suffix "b c d" (n = 3) occurs at 1 and 5
                ^^^^^ ^             ^^^^^     earliest: 1, so propose "x b c ..." (k tokens)

Vectorised with numpy: one comparison of the whole context with its last token, then the
surviving candidates only, one step back per n-gram length; a 4k-token context takes a few
microseconds of numpy work plus the call overhead. Pass a numpy array (for example a
:class:`TokenHistory` view): converting a long Python list costs more than the lookup.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from asyncpaged.spec_decode.config import SpeculativeConfig

TokenArray = npt.NDArray[np.integer]


def propose_ngram(
    token_ids: TokenArray | Sequence[int],
    *,
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int | None = None,
) -> list[int]:
    """Up to ``k`` proposed tokens for the context ``token_ids`` (prompt + output so far).

    Empty when no suffix of ``min_n``..``max_n`` tokens occurred earlier, when the context is
    shorter than ``min_n``, or when ``max_model_len`` leaves no room (at most
    ``max_model_len - len(token_ids)`` tokens are proposed, as in vLLM).
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}.")
    arr = np.asarray(token_ids)
    total = arr.shape[0]
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0 or total < max(min_n, 2):
        return []
    # ends: end positions (inclusive) of earlier occurrences of the suffix of length n; an
    # occurrence must end before the last token so that something follows it.
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    longest, best = 1, ends
    for back in range(1, max_n):
        ends = ends[ends >= back]
        ends = ends[arr[ends - back] == arr[total - 1 - back]]
        if ends.size == 0:
            break
        longest, best = back + 1, ends
    if longest < min_n:
        return []
    start = int(best[0]) + 1  # flatnonzero is ascending: best[0] is the earliest occurrence
    return [int(t) for t in arr[start : start + k]]


def propose_ngram_batch(
    contexts: Sequence[TokenArray | Sequence[int]],
    *,
    k: int | Sequence[int],
    min_n: int,
    max_n: int,
    max_model_len: int | None = None,
) -> list[list[int]]:
    """:func:`propose_ngram` for each context; ``k`` is one bound for all or one per context
    (0: no proposal for that sequence, e.g. one near its ``max_tokens``)."""
    ks = [k] * len(contexts) if isinstance(k, int) else list(k)
    if len(ks) != len(contexts):
        raise ValueError(f"{len(ks)} values of k for {len(contexts)} contexts.")
    return [
        propose_ngram(ctx, k=kk, min_n=min_n, max_n=max_n, max_model_len=max_model_len)
        for ctx, kk in zip(contexts, ks, strict=True)
    ]


class NgramProposer:
    """Prompt-lookup proposals with the sizes of a ``SpeculativeConfig(method="ngram")``."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int | None = None) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs method 'ngram', got {config.method!r}.")
        assert config.prompt_lookup_min is not None
        assert config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: TokenArray | Sequence[int], k: int | None = None) -> list[int]:
        """Proposals for one context; ``k`` (at most the config's) caps them further."""
        limit = self.k if k is None else min(k, self.k)
        return propose_ngram(
            token_ids, k=limit, min_n=self.min_n, max_n=self.max_n,
            max_model_len=self.max_model_len,
        )  # fmt: skip

    def propose_batch(
        self, contexts: Sequence[TokenArray | Sequence[int]], k: Sequence[int] | None = None
    ) -> list[list[int]]:
        limits = [self.k] * len(contexts) if k is None else [min(x, self.k) for x in k]
        return propose_ngram_batch(
            contexts, k=limits, min_n=self.min_n, max_n=self.max_n,
            max_model_len=self.max_model_len,
        )  # fmt: skip


class TokenHistory:
    """A sequence's tokens (prompt + output) in a growable int64 numpy buffer, so proposals read
    a view instead of converting a list each step. Amortised O(1) per appended token.

    Invariant: ``view()`` is ``buffer[:num_tokens]``, the tokens in order; ``truncate`` drops
    the tail (rejected tokens, if the caller appended proposals).
    """

    __slots__ = ("_buffer", "num_tokens")

    def __init__(self, token_ids: Sequence[int] = (), capacity: int = 256) -> None:
        self._buffer = np.empty(max(capacity, 2 * len(token_ids), 1), dtype=np.int64)
        self.num_tokens = len(token_ids)
        self._buffer[: self.num_tokens] = token_ids

    def extend(self, token_ids: Sequence[int]) -> None:
        end = self.num_tokens + len(token_ids)
        if end > self._buffer.shape[0]:
            grown = np.empty(max(2 * self._buffer.shape[0], end), dtype=np.int64)
            grown[: self.num_tokens] = self._buffer[: self.num_tokens]
            self._buffer = grown
        self._buffer[self.num_tokens : end] = token_ids
        self.num_tokens = end

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}.")
        self.num_tokens = num_tokens

    def view(self) -> npt.NDArray[np.int64]:
        """The tokens, read-only; valid until the next ``extend`` (which may reallocate)."""
        out = self._buffer[: self.num_tokens]
        out.flags.writeable = False
        return out
