"""The exception tree of asyncpaged.

AsyncPagedError
 +-- InvalidRequestError (also ValueError): a request refused before anything is queued
 |    (bad sampling values, empty prompt, too long, token ids outside the vocabulary,
 |    duplicate live request id). The engine keeps serving.
 +-- BlockPoolError (also ValueError): a call the block pool refuses (unknown sequence,
 |    duplicate id, operation on a sequence in the wrong place); the pool is left unchanged.
 +-- RequestFailedError: one request failed while it ran (its logits processor raised, or its
 |    constraints allowed no token); the cause is chained, the request's blocks are freed and
 |    every other request goes on.
 +-- NoTokenAllowedError (also ValueError): the cause of such a failure where a request's
 |    constraints (a grammar, allowed_token_ids, bad_words, min_tokens) ruled out every token.
 +-- EngineDeadError: the engine failed; every waiter gets it, with the cause chained.
 +-- EngineClosedError (also RuntimeError): a call on an engine that is not running (not started
 |    yet, or closed), or a second start of the same engine.
 +-- WorkerDiedError: a tensor-parallel worker process exited or its process group broke; it
      reaches waiters as the ``__cause__`` of an EngineDeadError.
"""

from __future__ import annotations


class AsyncPagedError(Exception):
    """Base class of every exception raised by asyncpaged."""


class InvalidRequestError(AsyncPagedError, ValueError):
    """A request that cannot be served as given; raised before anything is queued."""


class BlockPoolError(AsyncPagedError, ValueError):
    """A block-pool call that is not valid in the pool's current state.

    Raised before anything changes: the pool is exactly as it was before the call.
    """


class RequestFailedError(AsyncPagedError):
    """One request failed while running (``__cause__`` says why); the engine goes on."""


class NoTokenAllowedError(AsyncPagedError, ValueError):
    """A request's constraints ruled out every token at some step (a grammar whose every
    token ``allowed_token_ids`` excludes, say): the ``__cause__`` of its RequestFailedError."""


class EngineDeadError(AsyncPagedError):
    """The engine stopped because of an error; the original error is ``__cause__``."""


class EngineClosedError(AsyncPagedError, RuntimeError):
    """The engine is not running (not started yet, or closed); an engine starts only once."""


class WorkerDiedError(AsyncPagedError):
    """A tensor-parallel worker rank exited (or its collective failed) while the engine ran."""
