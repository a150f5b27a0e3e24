"""A step's rows, one :class:`SequenceStep` per scheduled sequence, built from the core's
scheduled sequences and the scheduler actor's records of them: the plain greedy fast path (no
options at all), and otherwise each row's sampling options (see :mod:`.sampling_options`),
structured outputs' grammar bitmasks, beam search's candidates, prompt-logprob targets,
speculative verification options and the number of draft-model proposals wanted after the
step; and, for a step planned ahead (async scheduling, ``model/late_inputs``), the late
sampling inputs of its rows once the step before it is back.

:class:`StepBuilder` is a class of its own, held by the scheduler actor: what the executor's
runner holds of the rows sent so far (its input batch: block tables, sampling options,
penalty histories, mirrored by one ``SentBatch``) and the bad words' token ids are state that
only row building reads and writes; it reads the core and the actor's records of the live
requests through their public attributes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from asyncpaged.actors.messages import Scheduled
from asyncpaged.actors.request_state import SchedulerRequestState
from asyncpaged.actors.sampling_options import (
    BadWordsCache,
    grammar_allows_only,
    sampling_options,
    verify_options,
)
from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.sched.lora_slots import LoRASlots
from asyncpaged.sched.request import Request
from asyncpaged.sched.request import Sequence as Seq
from asyncpaged.sched.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from asyncpaged.sched.scheduler_types import new_tuple
from asyncpaged.structured_outputs import GrammarBackend
from asyncpaged.worker.input_batch import SentBatch
from asyncpaged.worker.protocol import LateDelivery, LoRALoad, SequenceStep

# (request id, seq id, options read the output) of the rows whose sampling inputs come late
LateRows = tuple[tuple[str, int, bool], ...]


class StepBuilder:
    """Builds the scheduler actor's steps for the executor's runner and keeps what the runner
    holds of the rows sent (its input batch: block tables, sampling options, penalty
    histories), each row sent as its changes since the last plan sent.

    Invariant: after :meth:`build`, :meth:`sent` is called once the executor has the plan,
    and before the next :meth:`build`; ``states`` is the actor's own dict (the same object),
    holding every request of the core's scheduled sequences."""

    def __init__(
        self,
        scheduler: Scheduler,
        states: dict[str, SchedulerRequestState],
        *,
        eos_token_ids: frozenset[int],
        tokenizer: Any,
        grammars: GrammarBackend | None,
        has_draft_model: bool,
    ) -> None:
        """``tokenizer``: the loop's, for bad words; ``has_draft_model``: the engine's
        speculative method is "draft_model" (rows carry their whole penalty histories then,
        since the draft draws from the same options)."""
        self._scheduler = scheduler
        self._states = states
        self._eos = eos_token_ids
        self._bad_words = BadWordsCache(tokenizer)
        self._grammars = grammars
        self._has_draft_model = has_draft_model
        self._batch = SentBatch()  # what the executor's runner holds (``input_batch``)
        max_loras = scheduler.config.max_loras
        self._lora_slots = LoRASlots(max_loras) if max_loras else None  # None: LoRA off
        self.lora_loads: tuple[LoRALoad, ...] = ()  # the last plan's: its StepPlan carries them

    def sent(self) -> None:
        """The executor has the plan last built: its tables, options and histories are the
        runner's now."""
        self._batch.sent()

    def build(self, out: SchedulerOutput) -> tuple[list[SequenceStep], list[Scheduled], LateRows]:
        """One :class:`SequenceStep` per scheduled sequence of ``out``, in its order, each with
        its block table's changes since the last plan sent and a penalized row's output tokens
        since then, its sampling options unless the runner holds them (the caller calls
        :meth:`sent` once the executor has the plan); the scheduling facts to report for the
        requests scheduled for the first time or whose cached-token count changed; and the
        rows planned ahead whose sampling inputs come late (a grammar's bitmask, options that
        read the output: :meth:`late_inputs`), in row order."""
        scheduler, states = self._scheduler, self._states
        batch = self._batch
        has_draft_model = self._has_draft_model
        now = time.monotonic()
        steps = []
        scheduled = []
        late: list[tuple[str, int, bool]] = []
        batch.start_plan()
        # Draft-model engines send whole histories: the draft draws from the same options.
        keeps_history = not has_draft_model
        bitmasks = self._grammar_bitmasks(out)
        slot_of = self._assign_lora_slots(out)
        for s in out.seqs:
            t = states[s.request_id]
            request = scheduler.requests[s.request_id]
            key = request.lora_key
            lora_slot = slot_of.get(key, -1) if slot_of and key is not None else -1
            if t.reported_cached != request.num_cached_tokens:
                t.reported_cached = request.num_cached_tokens
                scheduled.append(Scheduled(
                    request_id=s.request_id, first_scheduled_time=now,
                    num_cached_tokens=request.num_cached_tokens,
                ))  # fmt: skip
            draft_k = (
                self._draft_k(request, s)
                if has_draft_model and request.num_speculative_tokens
                else 0
            )
            table = batch.table(s.seq_id, s.block_table)
            if t.info.plain and t.info.grammar is None and s.num_samples == 1:
                steps.append(new_tuple(SequenceStep, (
                    s.seq_id, s.token_ids, s.start_pos, s.slot_mapping, table[1], s.samples,
                    False, None, (), s.min_rope_len, (), 0, 0, s.num_draft, (), draft_k,
                    table[0], False, None, lora_slot,
                )))  # fmt: skip
                continue
            if s.token_ids[0] == PLACEHOLDER_TOKEN and _options_come_late(t, request, s):
                late.append((s.request_id, s.seq_id, True))  # (no options made twice)
                steps.append(new_tuple(SequenceStep, (
                    s.seq_id, s.token_ids, s.start_pos, s.slot_mapping, table[1], s.samples,
                    t.info.ranks_by_logprob, None, (), s.min_rope_len, (), 0, 0, 0, (), draft_k,
                    table[0], False, None, lora_slot,
                )))  # fmt: skip
                continue
            step = self._sampled_step(s, request, t, bitmasks, draft_k, table, keeps_history)
            if lora_slot >= 0:
                step = step._replace(lora_slot=lora_slot)
            if (
                s.token_ids[0] == PLACEHOLDER_TOKEN
            ):  # planned ahead: its options may read the output
                reads = not (t.info.plain or t.options_ahead)
                if reads or t.info.grammar is not None:
                    late.append((s.request_id, s.seq_id, reads))
            if step.sampling is not None:
                sampling, keep = batch.options(s.seq_id, step.sampling)
                if keep:
                    step = step._replace(sampling=sampling, keep_sampling=True)
            steps.append(step)
        return steps, scheduled, tuple(late)

    @property
    def num_lora_loads(self) -> int:
        """Adapters put into a LoRA slot so far (each a load the runner performs)."""
        return 0 if self._lora_slots is None else self._lora_slots.num_loads

    def _assign_lora_slots(self, out: SchedulerOutput) -> dict[str, int]:
        """The slot of each adapter ``out`` runs (empty without any), and the loads that put
        them there (:attr:`lora_loads`)."""
        self.lora_loads = ()
        if self._lora_slots is None:
            return {}
        scheduler, states = self._scheduler, self._states
        paths: dict[str, str] = {}
        for s in out.seqs:
            key = scheduler.requests[s.request_id].lora_key
            if key is not None and key not in paths:
                path = states[s.request_id].info.lora_path
                assert path is not None, f"request {s.request_id!r}: an adapter without a path"
                paths[key] = path
        if not paths:
            return {}
        slot_of, loads = self._lora_slots.assign(paths)
        self.lora_loads = tuple(LoRALoad(slot, paths[d], d) for slot, d in loads)
        return slot_of

    def _sampled_step(
        self,
        s: ScheduledSeq,
        request: Request,
        t: SchedulerRequestState,
        bitmasks: dict[tuple[int, int], torch.Tensor],
        draft_k: int,
        table: tuple[int, tuple[int, ...]],
        keeps_history: bool,
    ) -> SequenceStep:
        """The row of a sequence off the plain greedy path: its sampling options (or a
        fork's, or beam search's candidates), prompt-logprob targets and speculative
        verification options. A row sampled once, not verifying proposals, keeps its penalty
        history in the runner when ``keeps_history``."""
        eos_token_ids, bad_words = self._eos, self._bad_words
        seq = seq_of(request, s.seq_id)
        info = t.info
        params = info.params
        if s.num_samples > 1 or s.num_draft or request.beam is not None:
            keeps_history = False

        def options(index: int, keeps: bool = False) -> SamplingOptions | None:
            if request.beam is not None:  # each beam offers its 2k best continuations
                return SamplingOptions(temperature=0.0, num_logprobs=2 * request.beam.width)
            fixed = t.fixed_options.get(index)
            if fixed is not None and (keeps or fixed.history_seq is None):
                return fixed
            # The prompt as one tuple made by the intake, not sliced and copied for every
            # penalized row of every step.
            assert len(info.prompt_token_ids) == seq.num_prompt_tokens
            made = sampling_options(
                params, seq.token_ids, seq.num_prompt_tokens, index, eos_token_ids,
                bad_words.ids(params.bad_words), bitmasks.get((seq.seq_id, index)),
                info.prompt_token_ids, seq.seq_id if keeps else None,
                positional_key=True,
            )  # fmt: skip
            if _reads_no_output(params, seq) and (keeps or not _penalized(params)):
                # the same options at every later step (a penalized row's output goes with
                # the row: ``history``; a grammar's bitmask is made per step, late for a row
                # planned ahead: ``late_inputs``), which need no token in flight
                if made is not None and info.grammar is None:
                    t.fixed_options[index] = made
                t.options_ahead = True
            return made

        row_offset, targets = prompt_logprob_targets(
            t.prompt_known, info.prompt_token_ids, s.start_pos, len(s.token_ids)
        )
        verify: tuple[SamplingOptions | None, ...] = ()
        if s.num_draft:
            draft = s.token_ids[len(s.token_ids) - s.num_draft :]
            bad_words_ids = bad_words.ids(params.bad_words)
            verify = verify_options(params, seq, draft, eos_token_ids, bad_words_ids)
        sampling = options(seq.index, keeps_history) if s.samples else None
        history = None
        if sampling is not None and sampling.history_seq is not None:
            assert keeps_history
            # a row planned ahead: the runner adds the token in flight after the tail
            late = s.token_ids[-1] == PLACEHOLDER_TOKEN
            num_prompt = seq.num_prompt_tokens
            start = self._batch.history_start(seq.seq_id, seq.token_ids, num_prompt, late=late)
            history = (start, tuple(seq.token_ids[num_prompt + start :]), late)
        return SequenceStep(
            seq_id=s.seq_id,
            token_ids=s.token_ids,
            num_computed_tokens=s.start_pos,
            slot_mapping=s.slot_mapping,
            block_table=table[1],
            table_start=table[0],
            do_sample=s.samples,
            sampling=sampling,
            parallel_options=tuple(options(i) for i in range(s.num_samples))
            if s.num_samples > 1
            else (),
            want_logprob=info.ranks_by_logprob,
            min_rope_len=s.min_rope_len,
            prompt_targets=targets,
            prompt_row_offset=row_offset,
            num_prompt_logprobs=params.prompt_logprobs or 0,
            num_draft=s.num_draft,
            verify_options=verify,
            draft_k=draft_k,
            history=history,
        )

    def _draft_k(self, request: Request, s: ScheduledSeq) -> int:
        """Draft-model proposals wanted after this step's token: the core's
        :meth:`Scheduler.next_proposals` (none for a sequence backing off, above the batch
        limit, fewer near ``max_tokens`` or ``max_model_len``), drawn at the end of this step."""
        if not s.samples or s.num_samples != 1:
            return 0
        return self._scheduler.next_proposals(request, seq_of(request, s.seq_id))

    def _grammar_bitmasks(self, out: SchedulerOutput) -> dict[tuple[int, int], torch.Tensor]:
        """Structured outputs: (seq id, completion index) -> the next-token bitmask of that
        completion's matcher (made on its first step; it has accepted every token the
        completion holds), for every sampling row of the step, filled in one buffer; but a row
        planned ahead, whose matcher has yet to see the token in flight (its bitmask comes
        late: :meth:`late_inputs`)."""
        grammars = self._grammars
        keys: list[tuple[int, int]] = []
        matchers: list[Any] = []
        for s in out.seqs:
            t = self._states[s.request_id]
            if not s.samples or t.info.grammar is None or s.token_ids[0] == PLACEHOLDER_TOKEN:
                continue
            assert grammars is not None, "a compiled grammar without a grammar backend"
            request = self._scheduler.requests[s.request_id]
            seq = next(q for q in request.seqs if q.seq_id == s.seq_id)
            for index in range(s.num_samples) if s.num_samples > 1 else (seq.index,):
                matcher = t.matchers.get(index)
                if matcher is None:
                    matcher = t.matchers[index] = grammars.matcher(t.info.grammar)
                keys.append((s.seq_id, index))
                matchers.append(matcher)
        if not matchers:
            return {}
        assert grammars is not None
        rows = grammars.next_token_bitmasks(matchers)  # [R, W]
        return dict(zip(keys, rows.unbind(0), strict=True))

    def late_inputs(self, rows: LateRows) -> LateDelivery:
        """The late inputs of ``rows`` (the late rows of the step in flight), now that the step
        before it is back: its tokens are in the sequences and the matchers (and the tokens a
        grammar forced after them): the grammar bitmasks and output-reading options of its
        rows whose sequence that step sampled. Options are made as the sync engine makes them
        for the same output (a seeded row's generator key from its output length). A row
        whose sample is discarded or whose sequence has ended samples for nothing: plain greedy (no
        logits processor sees it), or as planned if its options read nothing. The runner keeps
        penalty histories but in a draft-model engine, whose rows carry their outputs."""
        scheduler, states, grammars = self._scheduler, self._states, self._grammars
        keeps_histories = not self._has_draft_model
        options: list[tuple[int, SamplingOptions | None]] = []
        masked: list[int] = []
        matchers: list[Any] = []
        for request_id, seq_id, reads in rows:
            request = scheduler.requests.get(request_id)
            t = states.get(request_id)
            seq = None if request is None or t is None else seq_of(request, seq_id)
            if seq is None or seq.is_finished or scheduler.sample_is_discarded(seq_id):
                if reads:
                    options.append((seq_id, None))
                continue
            assert t is not None
            info = t.info
            if reads:
                params = info.params
                made = sampling_options(
                    params, seq.token_ids, seq.num_prompt_tokens, seq.index, self._eos,
                    self._bad_words.ids(params.bad_words), None, info.prompt_token_ids,
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


def _options_come_late(t: SchedulerRequestState, request: Request, s: ScheduledSeq) -> bool:
    """Whether a row planned ahead gets its options only late (:meth:`StepBuilder.late_inputs`),
    none now: they read the output (and keep no penalty history in the runner, which needs the
    options at the row's start)."""
    if t.info.plain or t.options_ahead:
        return False
    params = t.info.params
    return not _penalized(params) and not _reads_no_output(params, seq_of(request, s.seq_id))


def _reads_no_output(params: SamplingParams, seq: Seq) -> bool:
    """Whether a completion's sampling options read no output token at any later step, but
    for the penalties' history and a grammar's bitmask: no logits processors (they read the
    output), bad words (the banned tokens follow it), and past its min-tokens mask (which
    never comes back). Without penalties and a grammar they are then fixed. A seed is no
    obstacle: the runner derives each draw's generator key from the row's position
    (``key_from_position``)."""
    return (
        not params.logits_processors
        and not params.bad_words
        and len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens
    )


def _penalized(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def prompt_logprob_targets(
    known: int | None, prompt: Sequence[int], start: int, num_new: int
) -> tuple[int, tuple[int, ...]]:
    """(row offset, prompt tokens they predict) for a step computing positions ``start ..
    start + num_new - 1`` of a request with ``known`` prompt logprobs (None: not asked): the
    rows whose prompt logprob is still unknown ((0, ()): none; a prefill recomputed after
    preemption skips the positions already known)."""
    if known is None:
        return 0, ()
    first = max(start, known - 1)
    end = min(start + num_new, len(prompt) - 1)
    if first >= end:
        return 0, ()
    return first - start, tuple(prompt[first + 1 : end + 1])


def seq_of(request: Request, seq_id: int) -> Seq:
    """The sequence ``seq_id`` of ``request`` (its only one, without a search, usually)."""
    if len(request.seqs) == 1:
        return request.seqs[0]
    return next(q for q in request.seqs if q.seq_id == seq_id)


assert SequenceStep._fields == (
    "seq_id", "token_ids", "num_computed_tokens", "slot_mapping", "block_table", "do_sample",
    "want_logprob", "sampling", "parallel_options", "min_rope_len", "prompt_targets",
    "prompt_row_offset", "num_prompt_logprobs", "num_draft", "verify_options", "draft_k",
    "table_start", "keep_sampling", "history", "lora_slot",
), "StepBuilder.build builds a plain row's SequenceStep in this order"  # fmt: skip
