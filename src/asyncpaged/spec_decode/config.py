"""``SpeculativeConfig``: how an engine proposes tokens for the target model to verify."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncpaged.errors import InvalidRequestError

SpeculativeMethod = Literal["ngram", "draft_model"]

DEFAULT_PROMPT_LOOKUP = 5
"""vLLM's n-gram size when neither ``prompt_lookup_min`` nor ``prompt_lookup_max`` is set."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's ``speculative_config`` field names).

    Each decode step proposes up to ``num_speculative_tokens`` tokens per sequence, the target
    model scores them all in one forward (``k + 1`` query tokens per sequence), and modified
    rejection sampling keeps a prefix of them plus one token of the target's: the output
    distribution is exactly the target's (greedy output is token for token the same).

    ``method="ngram"``: prompt lookup, proposals copied from the request's own prompt and output
    after the longest suffix n-gram of ``prompt_lookup_min..prompt_lookup_max`` tokens that
    occurred before (vLLM's defaults: both 5 when neither is set, the one set for both when only
    one is). ``model`` must be None. ``method="draft_model"``: a smaller checkpoint ``model``
    (required; same tokenizer) proposes; the prompt-lookup fields must stay unset.

    Invariants after ``__post_init__``: for "ngram", ``1 <= prompt_lookup_min <=
    prompt_lookup_max`` (both ints); for "draft_model", both are None and ``model`` is a
    non-empty str.
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft checkpoint directory or hub id ("draft_model" only)
    # No proposals while more sequences than this run (vLLM's field; None: never disabled)
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise InvalidRequestError(
                f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}."
            )
        k = self.num_speculative_tokens
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise InvalidRequestError(f"num_speculative_tokens must be at least 1, got {k!r}.")
        limit = self.disable_by_batch_size
        if limit is not None and not (
            isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1
        ):
            raise InvalidRequestError(f"disable_by_batch_size must be at least 1, got {limit!r}.")
        if self.method == "draft_model":
            self._check_draft_model()
        else:
            self._check_ngram()

    def _check_draft_model(self) -> None:
        if not (isinstance(self.model, str) and self.model):
            raise InvalidRequestError(
                "speculative method 'draft_model' needs model (a draft checkpoint directory or "
                f"hub id), got {self.model!r}."
            )
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise InvalidRequestError(
                "prompt_lookup_min and prompt_lookup_max apply to the 'ngram' method only."
            )

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise InvalidRequestError(
                "speculative method 'ngram' proposes from the request's own tokens: model must "
                f"be None, got {self.model!r}."
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
                raise InvalidRequestError(f"{name} must be at least 1, got {value!r}.")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None
        assert hi is not None
        if lo > hi:
            raise InvalidRequestError(
                f"prompt_lookup_min must be at most prompt_lookup_max, got {lo} > {hi}."
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
