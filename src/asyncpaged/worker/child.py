"""The runner process's side of ``executor_backend="process"`` (``worker/process.py`` is
the engine's): load the runner as told, then answer the engine's requests on the pipe, one at a
time and in the order sent, taking a running step's late sampling inputs off the pipe when it
asks for them (:class:`_PipeInputs`). The library's log events go to the engine's process
before each reply (``worker/runner_logs.py``)."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from asyncpaged.worker.draft import DraftSpec
from asyncpaged.worker.kv_tier_remote import tier_calls
from asyncpaged.worker.late_inputs import checked
from asyncpaged.worker.process import RunnerReady, result_to_wire
from asyncpaged.worker.protocol import LateDelivery, LoRALoad, SequenceStep, StepPlan
from asyncpaged.worker.runner import ModelRunner, WorkerSpec
from asyncpaged.worker.runner_logs import LIBRARY_LOGGER, LogCapture, capture_library_logs

# A step's rows cross the pipe as plain tuples (``runner_process._as_tuple_of``)
_as_tuple_of = tuple.__new__


def child_main(conn_fd: int, life_fd: int) -> None:
    """Entry of the runner process (``_BOOTSTRAP``): import what loading needs while the engine
    plans, read what to load, load the runner, answer, then serve requests until told to stop
    (``None``) or the engine's end of the pipe closes. ``life_fd``, the lifeline's write end, is
    never touched: it closes when the process exits, whichever way."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine owns this process's lifetime
    logs = capture_library_logs(logging.WARNING)  # the engine's level comes with the load
    conn = Connection(conn_fd)
    # What reading a checkpoint's config imports (its class's module pulls in most of it)
    import transformers.activations
    import transformers.models  # noqa: F401

    try:
        what = pickle.loads(conn.recv_bytes())
    except EOFError:  # the engine's process is gone
        return
    if what is None:  # the engine's start failed before the load (RunnerLaunch.abandon)
        return
    spec, device, draft, level = what
    logging.getLogger(LIBRARY_LOGGER).setLevel(level)
    _serve(conn, logs, spec, device, draft)


def _serve(
    conn: Connection, logs: LogCapture, spec: WorkerSpec, device: str, draft: DraftSpec | None
) -> None:
    def send(reply: RunnerReady | tuple[bool, object]) -> None:
        batch = logs.take()  # the events logged meanwhile go first (worker/runner_logs.py)
        if batch is not None:
            conn.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        conn.send_bytes(_dumps_reply(reply))

    try:
        torch.set_num_threads(spec.num_threads)
        runner = ModelRunner.from_spec(spec, device)
        if draft is not None:
            runner.load_draft(draft)
        runner.capture_cuda_graphs(spec.cuda_graph_sizes, spec.max_model_len)  # (and the draft's)
    except BaseException as exc:  # reported: the engine's start raises it
        send(RunnerReady(pid=os.getpid(), error=exc))
        return
    send(RunnerReady(pid=os.getpid(), rope_switch_len=runner.model.rope_switch_len,
                     kv_cache_bytes=runner.kv_cache.num_bytes))  # fmt: skip

    Wire = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[int, int], ...], tuple[int, ...],
                 tuple[tuple[int, str, str], ...]]  # fmt: skip

    def execute(wire: Wire) -> object:
        seqs, copy_pairs, late_rows, lora_loads = wire
        plan = StepPlan(seqs=tuple([_as_tuple_of(SequenceStep, s) for s in seqs]),
                        copy_pairs=copy_pairs, late_rows=late_rows,
                        lora_loads=tuple([LoRALoad(*load) for load in lora_loads]))  # fmt: skip
        return result_to_wire(runner.execute(plan))

    calls: dict[str, Callable[[Any], object]] = {
        "execute": execute, "swap_out": runner.swap_out, "swap_in": runner.swap_in,
        **tier_calls(runner),
    }  # fmt: skip
    pipe = runner.late_inputs = _PipeInputs(conn)
    while True:
        try:
            request = pipe.next_request()
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
        send(reply)


class _PipeInputs:
    """The process's side of its pipe: requests in the order sent, and the late sampling
    inputs a running step takes off the pipe before it samples (``late_inputs``). They
    follow that step's own request; whatever comes between (nothing, as the engine plans: a
    plan ahead starts no swap) is kept for after the step, in order."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._held: deque[Any] = deque()  # requests read while a step looked for its inputs

    def next_request(self) -> Any:
        """The next request (None: stop); raises EOFError once the engine's end is closed."""
        return self._held.popleft() if self._held else pickle.loads(self._conn.recv_bytes())

    def take(self, rows: tuple[int, ...]) -> LateDelivery:
        while True:
            msg = pickle.loads(self._conn.recv_bytes())
            if isinstance(msg, tuple) and msg[0] == "late_inputs":
                return checked(msg[1], rows)
            self._held.append(msg)
            if msg is None:  # told to stop: the inputs will not come
                raise RuntimeError("the engine stopped before a step's late sampling inputs came")


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
