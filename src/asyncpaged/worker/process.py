"""The model runner in a process of its own (``EngineConfig.executor_backend="process"``).

In one process the forward's thread and the event loop share the GIL: the forward needs it back
after every torch op, and while the loop runs Python (recording outputs, waking readers) it
waits up to the interpreter's switch interval (5 ms) for each one. So the loop's work and the
forward run in turn, not side by side. Here the runner lives in a child process: the loop
pickles each step's plan onto a pipe, awaits the reply's readability without a thread, and runs
Python while the other process computes.

::

   engine process (event loop thread)               runner process
   launch (first thing at start) ──────────────────► imports torch, transformers, the runner
   start: WorkerSpec ────────────────────────────────► builds the ModelRunner (and a draft)
          ◄──────────────────────────────── RunnerReady
   executor actor: pickle plan ─── pipe ───────────► execute (forward, sampling)
                   await readable ◄──────────────── sampled rows (or the error it raised)
   swap actor:     pickle pairs ─────────────────────► swap_out / swap_in
                   KV-tier ops ──────────────────────► the tier store (worker/kv_tier_remote.py)
   watchdog task:  lifeline pipe at EOF ─► engine dead
   (any reply)     ◄──────────────── log events first (worker/runner_logs.py)

The child is a fresh interpreter (``subprocess``, POSIX), not a ``multiprocessing`` spawn: it
imports its side (``worker/child.py``) and nothing of the host's, so a script needs no
``if __name__ == "__main__":`` guard and its top level never runs twice. It is launched before
the engine reads the checkpoint and plans, so its imports (~2 s, mostly torch and
transformers) overlap that.

The process runs requests one at a time, in the order they were sent; the engine may send a
step while the one before runs (async scheduling plans it ahead), and reads the replies in the
order it sent the requests (tickets).
Everything that crosses is pickled: the plan's sampling options included, so per-request
``logits_processors`` (arbitrary callables, often stateful) are refused in this mode. A draft
model (speculative decoding) is loaded in the process beside the runner.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import select
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio

from asyncpaged._log import get_logger
from asyncpaged.errors import WorkerDiedError
from asyncpaged.worker.draft import DraftSpec
from asyncpaged.worker.protocol import LateDelivery, SampledToken, StepPlan, StepResult
from asyncpaged.worker.runner import WorkerSpec, select_attention_backend
from asyncpaged.worker.runner_logs import LogBatch, emit, library_level

log = get_logger(__name__)

# A step's rows cross the pipe as plain tuples, rebuilt as their named tuples by tuple's own
# constructor: pickling a named tuple calls its Python ``__getnewargs__`` and ``__new__`` per row
# (plan 0.23 -> 0.09 ms to pickle, result 0.06 -> 0.04 ms to read back at 256 rows).
_as_tuple_of = tuple.__new__

#: A step's result on the pipe: (rows as plain tuples, compute_s, prompt_logprobs, cuda_graph).
ResultWire = tuple[tuple[tuple[Any, ...], ...], float, tuple[Any, ...], bool]


def result_to_wire(result: StepResult) -> ResultWire:
    """What the child sends for ``result`` (every field: :func:`result_from_wire` inverts it)."""
    rows = tuple([tuple(t) for t in result.sampled])
    return rows, result.compute_s, result.prompt_logprobs, result.cuda_graph


def result_from_wire(wire: ResultWire) -> StepResult:
    """The step's result from what :func:`result_to_wire` sent."""
    rows, compute_s, prompt_logprobs, cuda_graph = wire
    sampled = tuple([_as_tuple_of(SampledToken, row) for row in rows])
    return StepResult(sampled=sampled, compute_s=compute_s, prompt_logprobs=prompt_logprobs,
                      cuda_graph=cuda_graph)  # fmt: skip


START_TIMEOUT_S = 600.0  # loading a large checkpoint may take minutes
JOIN_TIMEOUT_S = 10.0  # a process told to stop exits within this, or is terminated
# A request larger than this waits until every reply is read (the pipe's buffer, 208 KiB by
# default, then holds at most a few smaller requests: a step of 256 decodes pickles to ~10 kB)
PIPELINE_BYTES = 32 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerReady:
    """The process's answer once its runner is loaded (or the error that stopped the load)."""

    pid: int
    rope_switch_len: int | None = None
    kv_cache_bytes: int = 0
    error: BaseException | None = None


# The child's first code: the host's import path, then this module's entry (argv: the pipe's
# and the lifeline's descriptors, then sys.path as JSON)
_BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
    "from asyncpaged.worker.child import child_main; "
    "child_main(int(sys.argv[1]), int(sys.argv[2]))"
)


class RunnerLaunch:
    """A runner process launched and importing, not yet told what to load.

    Invariant: until :meth:`start` hands the process to a :class:`RunnerProcess`, this owns it;
    :meth:`abandon` (idempotent) stops it when the engine's start fails before that.
    """

    def __init__(self) -> None:
        """Launch the child (a fresh interpreter; it starts importing at once)."""
        self._conn, child_conn = multiprocessing.Pipe()
        # The child holds the lifeline's write end until it exits: EOF here is its death
        self._life, child_life = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(child_conn.fileno()), str(child_life),
                 json.dumps(sys.path)],
                pass_fds=(child_conn.fileno(), child_life),
            )  # fmt: skip
        except BaseException:
            self._conn.close()
            os.close(self._life)
            raise
        finally:
            child_conn.close()
            os.close(child_life)
        self._taken = False

    def start(self, spec: WorkerSpec, device: str, draft: DraftSpec | None = None) -> RunnerProcess:
        """Send what to load and wait until the runner (and ``draft``, speculative decoding's
        draft model) is loaded (blocking: call it from a worker thread). Raises the load's
        error, or :class:`WorkerDiedError` if the process exits before it answers; nothing is
        left running then."""
        assert not self._taken, "a launch starts once"
        self._taken = True
        proc = RunnerProcess(self._popen, self._conn, self._life)
        try:
            # The attention backend is selected (and the C++ kernel compiled) here first, so
            # the process finds it built and cached.
            select_attention_backend(device, spec.attention_backend)
            self._conn.send_bytes(pickle.dumps((spec, device, draft, library_level())))
            while True:  # (its log events come first: worker/runner_logs.py)
                if not self._conn.poll(START_TIMEOUT_S):
                    raise WorkerDiedError(
                        f"the runner process did not start in {START_TIMEOUT_S} s"
                    )
                ready = pickle.loads(self._conn.recv_bytes())
                if not isinstance(ready, LogBatch):
                    break
                emit(ready)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            _stop(self._popen, 5.0)
            proc.close(graceful=False)
            raise WorkerDiedError(
                f"the runner process (pid {self._popen.pid}) exited with code "
                f"{self._popen.returncode} before its model was loaded (its error is above, on "
                "stderr)."
            ) from None
        except BaseException:
            proc.close(graceful=False)
            raise
        assert isinstance(ready, RunnerReady), f"bad ready reply {ready!r}"
        if ready.error is not None:
            proc.close(graceful=True)
            raise ready.error
        proc.ready = ready
        log.info("runner_process_started", pid=ready.pid, kv_cache_bytes=ready.kv_cache_bytes)
        return proc

    def abandon(self) -> None:
        """Stop the process if :meth:`start` never took it (the engine's start failed first)."""
        if not self._taken:
            self._taken = True
            RunnerProcess(self._popen, self._conn, self._life).close(graceful=True)


class RunnerProcess:
    """A :class:`ModelRunner` in a child process, driven from the event loop.

    Requests are pipelined: :meth:`send_execute` sends a step at once, even while earlier ones
    run (the process runs them in order, so it goes from one step to the next without waiting
    for the loop), and :meth:`result` reads its reply when its turn comes.

    Invariants: requests leave in ticket order and replies are read in the same order, each by
    the holder of its ticket (``_next_read``); one write at a time goes down the pipe (a
    large late delivery's, from a worker thread, holds back the requests after it); a
    request once sent is always read to its reply (shielded from cancellation) unless the
    process has died, so replies never answer the wrong request; a request over
    ``PIPELINE_BYTES`` is sent only when no reply is unread, so the unread requests never
    fill the pipe (a write blocking while the process blocks on its reply would deadlock);
    after :meth:`close` nothing is sent and the process has been reaped (terminated if it
    would not stop).
    """

    def __init__(self, popen: subprocess.Popen[bytes], conn: Connection, life: int) -> None:
        self.ready = RunnerReady(pid=popen.pid)  # what it loaded, once started
        self._popen = popen
        self._conn = conn
        self._life = life  # the lifeline's read end: readable (EOF) once the process is gone
        self._sent = 0  # tickets handed out (requests sent)
        self._next_read = 0  # the ticket whose reply is read next
        self._turns: dict[int, anyio.Event] = {}  # tickets waiting for their turn to read
        self._drained: anyio.Event | None = None  # set when no reply is left unread
        self._writing: anyio.Event | None = None  # set when a threaded write is done
        self._closed = False
        # Whether a reply is readable now, in one syscall: a reply already there is read
        # without registering the pipe with the event loop's selector and removing it again.
        self._readable = select.poll()
        self._readable.register(conn.fileno(), select.POLLIN)

    @property
    def pid(self) -> int | None:
        return self._popen.pid

    # ---- the runner's calls, awaited on the event loop ----------------------------------------

    async def send_execute(self, plan: StepPlan) -> int:
        """Send a step now (no checkpoint unless it must wait for the pipe); its ticket."""
        wire = (tuple([tuple(s) for s in plan.seqs]), plan.copy_pairs, plan.late_rows,
                tuple([tuple(load) for load in plan.lora_loads]))  # fmt: skip
        return await self._send("execute", wire)

    async def send_late_inputs(self, delivery: LateDelivery) -> None:
        """Send the late sampling inputs of a step sent before (``late_inputs``); one way, no
        reply. The step they are for may be running and reads them off the pipe before it
        samples, so they never wait for the pipe to drain (that step's reply needs them
        first). One over ``PIPELINE_BYTES`` (the bitmasks of many rows of a large
        vocabulary) is written from a worker thread: the pipe takes it only as the process
        reads it, after that step's forward, and the loop keeps running meanwhile; requests
        sent then wait for it (:meth:`_send`)."""
        if self._closed:
            raise WorkerDiedError("the runner process was stopped")
        data = pickle.dumps(("late_inputs", delivery), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) <= PIPELINE_BYTES:
            self._write(data)
            return
        writing = self._writing = anyio.Event()
        try:
            await anyio.to_thread.run_sync(self._write, data)
        finally:
            self._writing = None
            writing.set()

    def _write(self, data: bytes) -> None:
        try:
            self._conn.send_bytes(data)
        except OSError as exc:
            _reap(self._popen, 0.1)  # it is exiting: reap it for its exit code
            raise _died(self._popen) from exc

    async def result(self, ticket: int) -> StepResult:
        """The result of the step sent with ``ticket`` (after every earlier reply is read)."""
        wire = await self._receive(ticket)
        assert isinstance(wire, tuple)
        return result_from_wire(wire)

    async def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        await self.call("swap_out", pairs)

    async def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        await self.call("swap_in", pairs)

    async def call(self, method: str, arg: object) -> object:
        """One request to the process (after every one sent before) and its reply: a swap,
        or the KV tiers' ``"tiers_build"`` and ``"tier_ops"`` (``worker/kv_tier_remote.py``)."""
        return await self._receive(await self._send(method, arg))

    async def _send(self, method: str, arg: object) -> int:
        """Send one request; its ticket. Raises :class:`WorkerDiedError` if the process is
        stopped or gone."""
        data = pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL)
        while len(data) > PIPELINE_BYTES and self._next_read < self._sent:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()
        while self._writing is not None:  # a large delivery is going down the pipe
            await self._writing.wait()
        if self._closed:
            raise WorkerDiedError("the runner process was stopped")
        self._write(data)
        self._sent += 1
        return self._sent - 1

    async def _receive(self, ticket: int) -> object:
        """Read the reply of ``ticket`` in its turn; raises the error the process's runner
        raised, or :class:`WorkerDiedError` if the process is gone."""
        with anyio.CancelScope(shield=True):  # a sent request is read to its reply
            if ticket != self._next_read:
                turn = self._turns[ticket] = anyio.Event()
                await turn.wait()
            try:
                while True:  # the process's log events come before its reply
                    if not self._readable.poll(0):
                        await anyio.wait_readable(self._conn.fileno())
                    reply = pickle.loads(self._conn.recv_bytes())
                    if not isinstance(reply, LogBatch):
                        break
                    emit(reply)
                ok, value = reply
            except (EOFError, OSError) as exc:
                _reap(self._popen, 0.1)  # it is exiting: reap it for its exit code
                raise _died(self._popen) from exc
            finally:
                self._next_read += 1
                nxt = self._turns.pop(self._next_read, None)
                if nxt is not None:
                    nxt.set()
                if self._next_read == self._sent and self._drained is not None:
                    self._drained.set()
                    self._drained = None
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value

    # ---- liveness and shutdown -----------------------------------------------------------------

    async def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Until cancelled: when the process exits, call ``on_death`` at once (the engine fails
        every waiter), then raise :class:`WorkerDiedError`."""
        await anyio.wait_readable(self._life)
        _reap(self._popen, 0.1)  # it has exited: reap it for its exit code
        error = _died(self._popen)
        log.error("runner_process_died", pid=self._popen.pid, exitcode=self._popen.returncode)
        on_death(error)
        raise error

    def close(self, *, graceful: bool) -> None:
        """Stop the process (idempotent): ask it to leave and reap it (``graceful``, nothing on
        the pipe), or terminate it at once (the engine failed, a request may be unanswered)."""
        if self._closed:
            return
        self._closed = True
        if graceful and self._popen.poll() is None:
            try:
                self._conn.send_bytes(pickle.dumps(None))
            except OSError:
                graceful = False
        _stop(self._popen, JOIN_TIMEOUT_S if graceful else None)
        self._conn.close()
        os.close(self._life)
        log.info("runner_process_stopped", graceful=graceful, exitcode=self._popen.returncode)


def _died(popen: subprocess.Popen[bytes]) -> WorkerDiedError:
    return WorkerDiedError(
        f"the runner process (pid {popen.pid}) exited with code {popen.returncode}"
    )


def _reap(popen: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the process to exit (its exit code is then set)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout_s)


def _stop(popen: subprocess.Popen[bytes], join_timeout_s: float | None) -> None:
    """Reap the process (after ``join_timeout_s``, or at once: terminate, then kill)."""
    if join_timeout_s is not None:
        _reap(popen, join_timeout_s)
    if popen.poll() is None:
        popen.terminate()
        _reap(popen, 5.0)
    if popen.poll() is None:
        popen.kill()
        popen.wait()
