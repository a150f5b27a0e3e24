"""The late sampling inputs of a step planned ahead (async scheduling, ``model/late_inputs``):
once the step before it is back, the grammar bitmasks and output-reading options of its rows
whose sequence that step sampled."""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncpaged.actors.scheduler_outputs import Tracked
from asyncpaged.actors.scheduler_sampling import (
    BadWordsCache,
    grammar_allows_only,
    sampling_options,
)
from asyncpaged.actors.scheduler_steps import LateRows, seq_of
from asyncpaged.core.scheduler import Scheduler
from asyncpaged.model.late_inputs import LateDelivery
from asyncpaged.model.sampler import SamplingOptions
from asyncpaged.structured_outputs import GrammarBackend


def late_inputs(
    rows: LateRows,
    scheduler: Scheduler,
    tracked: dict[str, Tracked],
    grammars: GrammarBackend | None,
    eos_token_ids: frozenset[int],
    bad_words: BadWordsCache,
    *,
    keeps_histories: bool = True,
) -> LateDelivery:
    """The late inputs of ``rows`` (the late rows of the step in flight), now that the step
    before it is back: its tokens are in the sequences and the matchers (and the tokens a
    grammar forced after them). Options are made as the sync engine makes them for the
    same output (a seeded row's generator key from its output length). A row whose sample
    is void or whose sequence has ended samples in vain: plain greedy (no logits processor
    sees it), or as planned if its options read nothing. ``keeps_histories``: the runner
    keeps penalty histories (not in a draft-model engine, whose rows carry their outputs)."""
    options: list[tuple[int, SamplingOptions | None]] = []
    masked: list[int] = []
    matchers: list[Any] = []
    for request_id, seq_id, reads in rows:
        request = scheduler.requests.get(request_id)
        t = tracked.get(request_id)
        seq = None if request is None or t is None else seq_of(request, seq_id)
        if seq is None or seq.is_finished or scheduler.sample_is_void(seq_id):
            if reads:
                options.append((seq_id, None))
            continue
        assert t is not None
        info = t.info
        if reads:
            params = info.params
            made = sampling_options(
                params, seq.token_ids, seq.num_prompt_tokens, seq.index, eos_token_ids,
                bad_words.ids(params.bad_words), None, info.prompt_token_ids,
                seq_id if keeps_histories else None,
            )  # fmt: skip
            options.append((seq_id, made))
        matcher = t.matchers.get(seq.index)
        if matcher is not None:
            masked.append(seq_id)
            matchers.append(matcher)
    masks = None
    if matchers:
        assert grammars is not None, "a matcher without a grammar backend"
        masks = grammars.next_token_bitmasks(matchers).numpy()
        row_of = {sid: j for j, sid in enumerate(masked)}
        options = [
            (sid, made)
            if made is None or not made.min_tokens_mask_ids or sid not in row_of
            or not grammar_allows_only(masks[row_of[sid]], made.min_tokens_mask_ids)
            else (sid, dataclasses.replace(made, min_tokens_mask_ids=()))  # as sampling_options
            for sid, made in options
        ]  # fmt: skip
    return LateDelivery(rows=tuple(sid for _, sid, _ in rows), options=tuple(options),
                        masked=tuple(masked), masks=masks)  # fmt: skip
