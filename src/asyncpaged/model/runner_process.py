"""The model runner in a process of its own (``EngineConfig.executor_backend="process"``).

In one process the forward's thread and the event loop share the GIL: the forward needs it back
after every torch op, and while the loop runs Python (recording outputs, waking readers) it
waits up to the interpreter's switch interval (5 ms) for each one. So the loop's work and the
forward run in turn, not side by side. Here the runner lives in a spawned process: the loop
pickles each step's plan onto a pipe, awaits the reply's readability without a thread, and runs
Python while the other process computes.

::

   engine process (event loop thread)               runner process
   executor actor: pickle plan ─── pipe ───────────► execute (forward, sampling)
                   await readable ◄──────────────── sampled rows (or the error it raised)
   swap actor:     pickle pairs ─────────────────────► swap_out / swap_in
   watchdog task:  process exit ─► engine dead

The process runs requests one at a time, in the order they were sent; the engine keeps one
request on the pipe at a time (a lock), so each reply answers the request sent before it.
Everything that crosses is pickled: the plan's sampling options included, so per-request
``logits_processors`` (arbitrary callables, often stateful) are refused in this mode. A draft
model (speculative decoding) is loaded in the process beside the runner.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
import torch

from asyncpaged._log import get_logger
from asyncpaged.distributed.commands import WorkerSpec
from asyncpaged.errors import WorkerDiedError
from asyncpaged.model.draft import DraftSpec, load_draft
from asyncpaged.model.runner import (
    ModelRunner,
    SampledToken,
    SequenceStep,
    StepPlan,
    StepResult,
    select_attention_backend,
)

log = get_logger(__name__)

# A step's rows cross the pipe as plain tuples, rebuilt as their named tuples by tuple's own
# constructor: pickling a named tuple calls its Python ``__getnewargs__`` and ``__new__`` per row
# (plan 0.23 -> 0.09 ms to pickle, result 0.06 -> 0.04 ms to read back at 256 rows).
_as_tuple_of = tuple.__new__

START_TIMEOUT_S = 600.0  # loading a large checkpoint may take minutes
JOIN_TIMEOUT_S = 10.0  # a process told to stop exits within this, or is terminated


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerReady:
    """The process's answer once its runner is loaded (or the error that stopped the load)."""

    pid: int
    rope_switch_len: int | None = None
    kv_cache_bytes: int = 0
    error: BaseException | None = None


class RunnerProcess:
    """A :class:`ModelRunner` in a spawned process, driven from the event loop.

    Invariants: at most one request is on the pipe at a time (``_lock``); a request once sent is
    always read to its reply (shielded from cancellation) unless the process has died, so replies
    never answer the wrong request; after :meth:`close` nothing is sent and the process has been
    joined (terminated if it would not stop).
    """

    def __init__(self, proc: BaseProcess, conn: Connection, ready: RunnerReady) -> None:
        self.ready = ready
        self._proc = proc
        self._conn = conn
        # fast_acquire: a free pipe is taken without yielding, so the plan leaves at once (a
        # checkpoint here would run the output processor and every reader first)
        self._lock = anyio.Lock(fast_acquire=True)
        self._closed = False

    @classmethod
    def start(cls, spec: WorkerSpec, device: str, draft: DraftSpec | None = None) -> RunnerProcess:
        """Spawn the process and wait until its runner (and ``draft``, speculative decoding's
        draft model) is loaded (blocking: call it from a worker thread). Raises the load's
        error, or :class:`WorkerDiedError` if the process exits before it answers; nothing is
        left running then."""
        # The attention backend is selected (and the C++ kernel compiled) here first, so the
        # process finds it built and cached.
        select_attention_backend(device, spec.attention_backend)
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=_main, args=(child_conn, spec, device, draft),
                           name="asyncpaged-runner", daemon=True)  # fmt: skip
        proc.start()
        child_conn.close()
        try:
            if not conn.poll(START_TIMEOUT_S):
                raise WorkerDiedError(f"the runner process did not start in {START_TIMEOUT_S} s")
            ready = pickle.loads(conn.recv_bytes())
        except EOFError:
            proc.join(5.0)
            _stop(proc, None)
            raise WorkerDiedError(
                f"the runner process (pid {proc.pid}) exited with code {proc.exitcode} before "
                "its model was loaded (its error is above, on stderr). A script must start the "
                'engine under `if __name__ == "__main__":`: the process is spawned and imports '
                "the main module."
            ) from None
        except BaseException:
            _stop(proc, None)
            raise
        assert isinstance(ready, RunnerReady), f"bad ready reply {ready!r}"
        if ready.error is not None:
            _stop(proc, JOIN_TIMEOUT_S)
            raise ready.error
        log.info("runner_process_started", pid=ready.pid, kv_cache_bytes=ready.kv_cache_bytes)
        return cls(proc, conn, ready)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ---- the runner's calls, awaited on the event loop ----------------------------------------

    async def execute(self, plan: StepPlan) -> StepResult:
        wire = await self._call("execute", (tuple([tuple(s) for s in plan.seqs]), plan.copy_pairs))
        assert isinstance(wire, tuple)
        rows, compute_s, prompt_logprobs = wire
        sampled = tuple([_as_tuple_of(SampledToken, row) for row in rows])
        return StepResult(sampled=sampled, compute_s=compute_s, prompt_logprobs=prompt_logprobs)

    async def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        await self._call("swap_out", pairs)

    async def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        await self._call("swap_in", pairs)

    async def _call(self, method: str, arg: object) -> object:
        """Send one request and await its reply; raises the error the process's runner raised,
        or :class:`WorkerDiedError` if the process is gone."""
        data = pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL)
        async with self._lock:
            if self._closed:
                raise WorkerDiedError("the runner process was stopped")
            with anyio.CancelScope(shield=True):  # a sent request is read to its reply
                try:
                    self._conn.send_bytes(data)
                    await anyio.wait_readable(self._conn.fileno())
                    ok, value = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError) as exc:
                    self._proc.join(0.1)  # it is exiting: reap it for its exit code
                    raise _died(self._proc) from exc
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value

    # ---- liveness and shutdown -----------------------------------------------------------------

    async def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Until cancelled: when the process exits, call ``on_death`` at once (the engine fails
        every waiter), then raise :class:`WorkerDiedError`."""
        await anyio.wait_readable(self._proc.sentinel)
        self._proc.join(timeout=0.1)  # it has exited: reap it for its exit code
        error = _died(self._proc)
        log.error("runner_process_died", pid=self._proc.pid, exitcode=self._proc.exitcode)
        on_death(error)
        raise error

    def close(self, *, graceful: bool) -> None:
        """Stop the process (idempotent): ask it to leave and join it (``graceful``, nothing on
        the pipe), or terminate it at once (the engine failed, a request may be unanswered)."""
        if self._closed:
            return
        self._closed = True
        if graceful and self._proc.exitcode is None:
            try:
                self._conn.send_bytes(pickle.dumps(None))
            except OSError:
                graceful = False
        _stop(self._proc, JOIN_TIMEOUT_S if graceful else None)
        self._conn.close()
        log.info("runner_process_stopped", graceful=graceful, exitcode=self._proc.exitcode)


def _died(proc: BaseProcess) -> WorkerDiedError:
    return WorkerDiedError(f"the runner process (pid {proc.pid}) exited with code {proc.exitcode}")


def _stop(proc: BaseProcess, join_timeout_s: float | None) -> None:
    """Join the process (after ``join_timeout_s``, or at once: terminate, then kill)."""
    if join_timeout_s is not None:
        proc.join(join_timeout_s)
    if proc.exitcode is None:
        proc.terminate()
        proc.join(5.0)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


def _main(conn: Connection, spec: WorkerSpec, device: str, draft: DraftSpec | None) -> None:
    """Entry of the spawned process: load the runner, answer, then serve requests until told
    to stop (``None``) or the engine's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine owns this process's lifetime
    try:
        runner = _build(spec, device)
        if draft is not None:
            load_draft(runner, draft)
    except BaseException as exc:  # reported: the engine's start raises it
        conn.send_bytes(_dumps_reply(RunnerReady(pid=os.getpid(), error=exc)))
        return
    ready = RunnerReady(pid=os.getpid(), rope_switch_len=runner.model.rope_switch_len,
                        kv_cache_bytes=runner.kv_cache.num_bytes)  # fmt: skip
    conn.send_bytes(_dumps_reply(ready))

    def execute(wire: tuple[tuple[tuple[Any, ...], ...], tuple[tuple[int, int], ...]]) -> object:
        seqs, copy_pairs = wire
        plan = StepPlan(seqs=tuple([_as_tuple_of(SequenceStep, s) for s in seqs]),
                        copy_pairs=copy_pairs)  # fmt: skip
        result = runner.execute(plan)
        return tuple([tuple(t) for t in result.sampled]), result.compute_s, result.prompt_logprobs

    calls: dict[str, Callable[[Any], object]] = {
        "execute": execute, "swap_out": runner.swap_out, "swap_in": runner.swap_in,
    }  # fmt: skip
    while True:
        try:
            request = pickle.loads(conn.recv_bytes())
        except EOFError:  # the engine's process is gone
            return
        if request is None:  # done: skip the interpreter's teardown (~1 s of module cleanup)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        method, arg = request
        try:
            reply: tuple[bool, object] = (True, calls[method](arg))
        except Exception as exc:  # the engine raises it where the call was awaited
            reply = (False, exc)
        conn.send_bytes(_dumps_reply(reply))


def _dumps_reply(reply: RunnerReady | tuple[bool, object]) -> bytes:
    """``reply`` pickled; one that does not pickle (an error of a type defined where the
    engine cannot import it) goes as a RuntimeError with its text."""
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        what = reply.error if isinstance(reply, RunnerReady) else reply[1]
        error = RuntimeError(f"the runner process's reply did not pickle ({exc!r}): {what!r}")
        if isinstance(reply, RunnerReady):
            return pickle.dumps(RunnerReady(pid=reply.pid, error=error))
        return pickle.dumps((False, error))


def _build(spec: WorkerSpec, device: str) -> ModelRunner:
    torch.set_num_threads(spec.num_threads)
    backend = select_attention_backend(device, spec.attention_backend)
    return ModelRunner(
        spec.model, getattr(torch, spec.dtype), spec.num_device_blocks, spec.block_size,
        spec.num_host_blocks, device=device, attn_backend=backend, seed=spec.seed,
        kv_cache_dtype=getattr(torch, spec.kv_cache_dtype), packed_linears=spec.packed_linears,
        fused_elementwise=spec.fused_elementwise, screened_lm_head=spec.screened_lm_head,
        int8_lm_head=spec.int8_lm_head,
    )  # fmt: skip
