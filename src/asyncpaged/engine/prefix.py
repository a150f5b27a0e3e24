"""Pinned prefixes, for ``engine.pin_prefix`` and ``engine.unpin_prefix``: the handle, and the
exchanges with the scheduler that pin a prefix's blocks and unpin them.

A pin is a one-token greedy request tagged with a pin id: the scheduler is told to watch for
it (:class:`WatchPin`) before the request is submitted, and the request's last transaction
pins its full blocks and reports them in the watch's slot. A call that will not return its
handle (refused, failed, cancelled) releases the pin, or tells the scheduler to release it when
that transaction comes (:class:`ForgetPin`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from asyncpaged.actors.intake import IntakeActor, tokenize
from asyncpaged.actors.messages import ForgetPin, SchedulerInbox, UnpinPrefix, WatchPin
from asyncpaged.actors.worker_thread import WorkerThreadClosedError
from asyncpaged.config import EngineConfig
from asyncpaged.errors import EngineClosedError, InvalidRequestError
from asyncpaged.kv.block_table import PinnedPrefix
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.streams import RequestStream

__all__ = ["PrefixHandle", "pin_token_ids", "prefix_token_ids", "release_pin", "unpin_handle"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHandle:
    """A pinned prefix (from :meth:`AsyncEngine.pin_prefix`)."""

    pool_pin_id: int
    num_tokens: int  # tokens in its pinned full blocks
    num_blocks: int


async def prefix_token_ids(
    prefix: str | Sequence[int], cfg: EngineConfig, intake: IntakeActor, tokenizer: Any
) -> list[int]:
    """The prefix's token ids (a text is tokenized on the intake's worker thread with the
    intake's ``tokenizer``); refused without prefix caching or when shorter than one block.
    :class:`EngineClosedError` if the intake has stopped already (:func:`_stopping_is_closed`)."""
    if not cfg.enable_prefix_caching:
        raise InvalidRequestError("pin_prefix needs enable_prefix_caching=True.")
    if isinstance(prefix, str):
        with _stopping_is_closed():
            ids: list[int] = await intake.thread.run(tokenize, tokenizer, prefix)
    else:
        ids = list(prefix)
    if len(ids) < cfg.block_size:
        raise InvalidRequestError(
            f"a pinned prefix needs at least one full block of {cfg.block_size} "
            f"tokens, got {len(ids)}."
        )
    return ids


async def pin_token_ids(
    ids: list[int],
    pin_id: int,
    cache_salt: str | None,
    *,
    control: MemoryObjectSendStream[SchedulerInbox],
    submit: Callable[[Sequence[int], SamplingParams, str, str | None, int], RequestStream],
    wait_or_dead: Callable[[Callable[[], Awaitable[object]]], Awaitable[None]],
    check_alive: Callable[[], None],
) -> PrefixHandle:
    """Compute ``ids`` as request ``pin-{pin_id}`` (``submit``) and return the handle of the
    blocks its transaction pinned. If cancelled midway (or failing), nothing stays pinned; if the
    actors have already stopped, raises :class:`EngineClosedError` (:func:`_stopping_is_closed`)."""
    event: anyio.Event = anyio.Event()
    slot: list[PinnedPrefix | None] = []
    with _stopping_is_closed():
        control.send_nowait(WatchPin(pin_id=pin_id, event=event, slot=slot))
    returned = False
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        with _stopping_is_closed():
            stream = submit(ids, params, f"pin-{pin_id}", cache_salt, pin_id)
        await stream
        await wait_or_dead(event.wait)  # set by the pin's transaction
        check_alive()
        returned = True
    finally:
        if not returned:  # refused, failed or cancelled: nobody will hold the handle
            release_pin(pin_id, slot, control)
    pinned = slot[0]
    if pinned is None:  # evicted before it could be pinned: only under extreme pressure
        raise InvalidRequestError("the prefix was evicted before it could be pinned; retry.")
    return PrefixHandle(pool_pin_id=pinned.pin_id, num_tokens=pinned.num_tokens,
                        num_blocks=len(pinned.block_ids))  # fmt: skip


def release_pin(
    pin_id: int, slot: list[PinnedPrefix | None], control: MemoryObjectSendStream[SchedulerInbox]
) -> None:
    """A ``pin_prefix`` call that will not return its handle: unpin what its transaction
    pinned, or tell the scheduler to unpin it when that transaction comes."""
    pinned = slot[0] if slot else None
    msg: UnpinPrefix | ForgetPin
    if pinned is not None:
        msg = UnpinPrefix(pool_pin_id=pinned.pin_id, handled=anyio.Event())
    elif not slot:
        msg = ForgetPin(pin_id=pin_id, slot=slot)
    else:
        return  # the transaction came and pinned nothing
    with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
        control.send_nowait(msg)


async def unpin_handle(
    handle: PrefixHandle,
    control: MemoryObjectSendStream[SchedulerInbox],
    wait_or_dead: Callable[[Callable[[], Awaitable[object]]], Awaitable[None]],
) -> None:
    """Tell the scheduler to unpin the handle's blocks and wait (``wait_or_dead``) until it has
    taken the unpin."""
    msg = UnpinPrefix(pool_pin_id=handle.pool_pin_id, handled=anyio.Event())
    control.send_nowait(msg)
    await wait_or_dead(msg.handled.wait)


@contextlib.contextmanager
def _stopping_is_closed() -> Iterator[None]:
    """The engine's actors have stopped (their threads closed, their inboxes' receive ends gone)
    while the engine still looks alive: a failing engine's actors stop before it marks itself
    dead. A call made then gets :class:`EngineClosedError` (the cause chained), not the bare
    error of a thread or stream. Only for calls into the intake, the scheduler's inbox or the
    intake's thread: nothing else raises these from there."""
    try:
        yield
    except (WorkerThreadClosedError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        raise EngineClosedError("the engine is not running: it is stopping.") from exc
