"""The runner's result row for one draw (:class:`SampledToken`): what a step's sampler produced
for a sequence, read by the scheduler core's update and carried on to the output processor. A
plain record at the bottom of the layers (as vLLM's ``ModelRunnerOutput``), so the core reads
the runner's rows without importing the worker."""

from __future__ import annotations

from typing import NamedTuple


class SampledToken(NamedTuple):
    """A sampled token; logprobs are the log-softmax of the raw float32 logits (vLLM v1). A
    named tuple: a step makes one per sampling row, and a tuple is the cheapest immutable
    record to build."""

    seq_id: int
    token_id: int
    logprob: float | None  # of the sampled token, if asked
    rank: int | None = None  # 1-based rank of the sampled token by raw logprob, if asked
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    sample_index: int = 0  # which entry of the step's ``parallel_options`` drew it
    error: BaseException | None = None  # the row's logits processor raised: the request fails
    accepted: tuple[int, ...] = ()  # speculative decoding: the proposals kept before token_id
    proposals: tuple[int, ...] = ()  # the draft model's proposals to follow token_id


assert SampledToken._fields == (
    "seq_id", "token_id", "logprob", "rank", "top_logprobs", "sample_index", "error",
    "accepted", "proposals",
), "sampled_tokens and the scheduler core build SampledToken rows in this order"  # fmt: skip
