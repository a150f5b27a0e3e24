"""Prompt-lookup proposals: vLLM's matching rule, checked against a brute-force reference."""

from __future__ import annotations

import time

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from asyncpaged import SpeculativeConfig
from asyncpaged.spec_decode import NgramProposer, TokenHistory, propose_ngram, propose_ngram_batch


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram (max_n down to min_n) at its earliest earlier occurrence that
    something follows, and up to k tokens after it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for start in range(total - n):  # the occurrence ends before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_vllms_docstring_example() -> None:
    # [4, 2, 3] has no earlier match; [2, 3] matches at 1 and only 3 tokens follow it
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=3) == [4, 2, 3]


def test_the_longest_match_wins_and_the_earliest_of_equals() -> None:
    tokens = [7, 1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 1, 2, 3]
    # [1, 2, 3] occurs at 1 (longest); [2, 3] would also match later at 7
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [50, 51]
    tokens = [5, 8, 40, 5, 8, 41, 5, 8]
    assert propose_ngram(tokens, k=1, min_n=2, max_n=2) == [40]  # earliest of the two


def test_no_match_short_contexts_and_length_caps() -> None:
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=2) == []
    assert propose_ngram([1], k=3, min_n=1, max_n=2) == []
    assert propose_ngram([1, 2], k=3, min_n=3, max_n=3) == []
    assert propose_ngram([1, 2, 1, 2, 1], k=3, min_n=3, max_n=3) == [2, 1]  # overlapping match
    assert propose_ngram([0, 0, 0, 0], k=5, min_n=1, max_n=3) == [0]
    assert propose_ngram([1, 2, 3, 1, 2], k=3, min_n=2, max_n=2, max_model_len=7) == [3, 1]
    assert propose_ngram([1, 2, 3, 1, 2], k=3, min_n=2, max_n=2, max_model_len=5) == []
    assert propose_ngram([1, 2, 3, 1, 2], k=0, min_n=2, max_n=2) == []
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], k=1, min_n=3, max_n=2)


@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(1, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_equals_the_brute_force_reference(
    tokens: list[int], k: int, min_n: int, extra: int
) -> None:
    max_n = min_n + extra
    want = reference(tokens, k, min_n, max_n)
    assert propose_ngram(tokens, k=k, min_n=min_n, max_n=max_n) == want
    assert propose_ngram(np.array(tokens, dtype=np.int32), k=k, min_n=min_n, max_n=max_n) == want


def test_batch_and_proposer_and_history() -> None:
    config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3
    )
    proposer = NgramProposer(config)
    contexts = [[1, 2, 3, 1, 2], [4, 5, 6], [9, 9, 9]]
    assert proposer.propose_batch(contexts) == [[3, 1], [], [9]]
    assert proposer.propose_batch(contexts, k=[1, 2, 0]) == [[3], [], []]
    assert proposer.propose([1, 2, 3, 1, 2], k=5) == [3, 1]  # never more than the config's k
    assert propose_ngram_batch(contexts, k=[2, 2, 2], min_n=1, max_n=3) == [[3, 1], [], [9]]
    history = TokenHistory([1, 2, 3], capacity=2)
    history.extend([1, 2])
    assert proposer.propose(history.view()) == [3, 1]
    history.extend(list(range(100, 400)))  # grows past its capacity
    assert history.view()[-1] == 399
    assert len(history.view()) == 305
    history.truncate(5)
    assert history.view().tolist() == [1, 2, 3, 1, 2]
    with pytest.raises(ValueError, match="truncate"):
        history.truncate(6)
    with pytest.raises(ValueError, match="method 'ngram'"):
        NgramProposer(SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="d"))


def test_a_4k_context_is_a_vectorised_lookup() -> None:
    """Not a benchmark: a loose bound that a per-token Python loop (milliseconds on 4k tokens)
    would miss and a loaded CI machine will not (typical: 15-30 us on one core; the best of 7
    batches is taken, so a descheduled batch does not count)."""
    rng = np.random.default_rng(0)
    cases = [
        rng.integers(0, 32000, 4096),  # natural-language-like: rare repeats
        np.tile(rng.integers(0, 50, 64), 64),  # highly repetitive (code, lists)
        rng.integers(0, 4, 4096),  # tiny vocabulary: many candidate matches
    ]
    for tokens in cases:
        propose_ngram(tokens, k=5, min_n=2, max_n=5)
        timings = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(200):
                propose_ngram(tokens, k=5, min_n=2, max_n=5)
            timings.append((time.perf_counter() - start) / 200)
        assert min(timings) < 500e-6
