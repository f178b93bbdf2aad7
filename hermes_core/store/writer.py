"""The store's writer: threads that run every mutation, many callers' steps per commit.

Every mutating store operation is a *step* (a function) handed to :class:`StoreWriter`. A
writer thread takes all steps waiting, runs them inside one backend transaction and commits once
(group commit); each caller resumes only after the commit that holds its step. No caller waits
on a lock, the disk or the network on its own thread: an asyncio host awaits
:meth:`StoreWriter.arun` and its event loop stays free.

A backend with several writer connections (PostgreSQL) gets one writer thread per connection.
A step that names its lane (the session key of a conversation) runs on the writer thread that
lane hashes to, so one lane's steps stay in order and its read-modify-writes never race, while
other lanes' steps commit in parallel on other connections. A step without a lane runs alone:
every writer thread finishes what was handed over before it, one of them runs it while the
others wait, and only then do they go on, so it is ordered against every other step. With one
writer thread all of this reduces to one queue. On a store that other processes write at the same
time, a batch's steps run in the order of their lanes, so that every process's transactions lock
the lanes' rows in one order (see ``lock_order``).

A step that raises spoils its batch: the transaction is rolled back, ``on_abort`` runs (the
store drops its entry cache, which may hold the batch's uncommitted state), and every step of the
batch runs again on its own, so one bad message fails only its own caller. Work a step defers
with :meth:`StoreWriter.after_commit` (observer events) runs only once its commit is done; what
it registers with :meth:`StoreWriter.on_rollback` undoes its in-memory changes (queue lists) if
its batch is rolled back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hermes_core.domain.errors import ReadOnlyStoreError, StoreUnavailableError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MAX_BATCH = 256
"""Steps committed together at most (a bound on how long one transaction holds the lock)."""


@dataclass
class _Step:
    run: Callable[[], Any]
    future: Future[Any] | asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop | None = None
    """The event loop of an awaiting coroutine (its future is settled there)."""
    alone: bool = False
    """Run outside any batch (its writes commit one by one, so its own reads see them)."""
    barrier: threading.Barrier | None = None
    """Several writer threads: the step runs while every thread waits here (twice: before and
    after it), so it is ordered against every step of every lane."""
    deferred: list[Callable[[], None]] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)
    lane: str = ""
    """The session key whose state the step changes ("": none, the step is ordered against
    every lane)."""


def _lane(step: _Step) -> str:
    return step.lane


def _in_lock_order(batch: list[_Step]) -> list[_Step]:
    """The batch with the steps between two lane-less ones sorted by lane (stably: one lane's
    steps keep their order; a lane-less step keeps its place against all others)."""
    ordered: list[_Step] = []
    run: list[_Step] = []
    for step in batch:
        if step.lane:
            run.append(step)
            continue
        ordered += sorted(run, key=_lane)
        ordered.append(step)
        run = []
    ordered += sorted(run, key=_lane)
    return ordered


class StoreWriter:
    """Runs store mutations on one thread, committing concurrent callers' steps together."""

    def __init__(
        self,
        transaction: Callable[[], AbstractContextManager[object]],
        on_abort: Callable[[], None],
        *,
        atomic: Callable[[], bool] = lambda: True,
        name: str = "hermes-store-writer",
        read_only: bool = False,
        threads: int = 1,
        bind: Callable[[int], None] = lambda index: None,
        lock_order: bool = False,
        observe: Callable[[float, int], None] | None = None,
        prepare: Callable[[list[str]], AbstractContextManager[object]] = lambda _: nullcontext(),
    ) -> None:
        """``threads``: writer threads; thread ``i`` calls ``bind(i)`` first (the backend gives it
        writer connection ``i``). ``lock_order``: run each batch's steps in the order of their
        lanes (a store that other processes write at the same time: every batch then locks
        its lanes' rows in one order, so two processes' batches never wait for each other in
        a cycle, which the database would end after its deadlock timeout by failing one).
        ``observe(seconds, steps)``: called on the writer thread after each commit, with how
        long it took and how many steps it held. ``prepare(lanes)``: entered on the writer
        thread inside each batch's transaction before its steps, and left before it commits,
        with the lanes of its steps (the store reads their routes at once)."""
        self._transaction = transaction
        self._prepare = prepare
        self._observe = observe
        self._lock_order = lock_order
        self._atomic = atomic
        """Whether a transaction can be rolled back now; if not, steps run one by one (a
        batch's steps could not run again after a failure without repeating their writes)."""
        self._on_abort = on_abort
        self._bind = bind
        self._queues: list[queue.SimpleQueue[_Step | None]] = [
            queue.SimpleQueue() for _ in range(threads)
        ]
        self._local = threading.local()
        """Per thread: ``writer`` (True on a writer thread) and ``step`` (the step it runs)."""
        self._handing_over = threading.Lock()
        """Held while a step goes into every queue: two such steps handed over at once by two
        threads must reach every queue in the same order, or each writer thread would wait at
        the other step's barrier for good."""
        self._closed = False
        self._counts = [[0, 0] for _ in range(threads)]
        """Batches committed and steps run, per writer thread (each counts its own)."""
        self._read_only = read_only
        """A read-only store's writer runs nothing: every step is refused, no thread runs."""
        self._threads = [
            threading.Thread(
                target=self._loop, args=(index,), daemon=True,
                name=name if threads == 1 else f"{name}-{index}",
            )
            for index in range(threads)
        ]  # fmt: skip
        if not read_only:
            for thread in self._threads:
                thread.start()

    @property
    def on_writer_thread(self) -> bool:
        """Whether the caller is a writer thread (inside a step)."""
        on_writer: bool = getattr(self._local, "writer", False)
        return on_writer

    @property
    def _current(self) -> _Step | None:
        """The step the calling writer thread runs now (None on any other thread)."""
        step: _Step | None = getattr(self._local, "step", None)
        return step

    def run(
        self, function: Callable[..., _T], *args: Any, alone: bool = False, lane: str | None = None
    ) -> _T:
        """Run ``function(*args)`` as a step and return its result once committed (blocking).

        ``lane``: the session key whose state the step changes (None: it runs alone, ordered
        against every lane). ``alone``: outside any batch, for maintenance that reads back what
        it wrote through other connections. Called from a step (a writer thread) it runs
        inline, as part of that step.
        """
        if self.on_writer_thread:
            return function(*args)
        future: Future[_T] = Future()
        self._put(_Step(lambda: function(*args), future, alone=alone), lane)
        return future.result()

    async def arun(self, function: Callable[..., _T], *args: Any, lane: str | None = None) -> _T:
        """Run ``function(*args)`` as a step of ``lane``; the awaiting coroutine resumes after
        the commit (a cancelled caller does not undo the step: it runs and commits all the
        same)."""
        return await self.submit(function, *args, lane=lane)

    def submit(
        self, function: Callable[..., _T], *args: Any, lane: str | None = None
    ) -> asyncio.Future[_T]:
        """Hand over ``function(*args)`` as a step of ``lane`` now (one lane's steps, and steps
        without a lane, run in the order handed over), without waiting: the returned future
        of the running event loop settles after the commit."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._put(_Step(lambda: function(*args), future, loop), lane)
        return future

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the current step is committed (at once outside a step)."""
        step = self._current
        if step is None:
            callback()
        else:
            step.deferred.append(callback)

    def on_rollback(self, callback: Callable[[], None]) -> None:
        """Undo an in-memory change of the current step if its batch is rolled back (the step
        then runs again); nothing outside a step."""
        step = self._current
        if step is not None:
            step.undo.append(callback)

    def stats(self) -> dict[str, int]:
        """Batches committed and steps run so far (steps per batch shows the grouping)."""
        return {
            "batches": sum(count[0] for count in self._counts),
            "steps": sum(count[1] for count in self._counts),
        }

    def close(self) -> None:
        """Finish the steps already handed over, then stop the threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._handing_over:  # after a step being put in every queue, never amid it
            for waiting in self._queues:
                waiting.put(None)
        if not self.on_writer_thread and not self._read_only:
            for thread in self._threads:
                thread.join()

    def _put(self, step: _Step, lane: str | None) -> None:
        if self._read_only:
            raise ReadOnlyStoreError(
                "the session store was opened read-only, so nothing was changed; open it "
                "without read_only=True to change it (one writer per database at a time)."
            )
        if self._closed:
            raise StoreUnavailableError("the session store is closed; open it again to write.")
        if lane is not None and not step.alone:
            step.lane = lane
        if len(self._queues) == 1:
            self._queues[0].put(step)
        elif lane is None or step.alone:
            step.barrier = threading.Barrier(len(self._queues))
            with self._handing_over:
                for waiting in self._queues:
                    waiting.put(step)
        else:
            self._queues[zlib.crc32(lane.encode("utf-8", "surrogatepass")) % len(self._queues)].put(
                step
            )

    # -- the writer thread ---------------------------------------------------------------------

    def _loop(self, index: int) -> None:
        self._local.writer = True
        self._bind(index)
        waiting = self._queues[index]
        counts = self._counts[index]
        pending: _Step | None = None
        while True:
            first = pending if pending is not None else waiting.get()
            pending = None
            if first is None:
                return
            if first.barrier is not None:
                self._exclusive(first, first.barrier, counts)
                continue
            if first.alone or not self._atomic():
                self._alone(first, counts)
                continue
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    step = waiting.get_nowait()
                except queue.Empty:
                    break
                if step is None or step.alone or step.barrier is not None:
                    pending = step
                    break
                batch.append(step)
            self._commit(_in_lock_order(batch) if self._lock_order else batch, counts)
            if pending is None and self._closed and waiting.empty():
                return

    def _exclusive(self, step: _Step, barrier: threading.Barrier, counts: list[int]) -> None:
        """Run a step without a lane once every writer thread has reached it (each has it in
        its queue), while the others wait: it sees and precedes nothing half-done."""
        if barrier.wait() == 0:
            try:
                if step.alone or not self._atomic():
                    self._alone(step, counts)
                else:
                    self._commit([step], counts)
            finally:
                barrier.wait()
        else:
            barrier.wait()

    def _commit(self, batch: list[_Step], counts: list[int]) -> None:
        """Run the batch in one transaction; on any failure run each step alone."""
        results: list[Any] = []
        began = time.perf_counter()
        try:
            with self._transaction(), self._prepare([step.lane for step in batch if step.lane]):
                for step in batch:
                    results.append(self._execute(step, counts))
        except BaseException as exc:  # noqa: BLE001 - isolated per step below
            for step in reversed(batch):
                self._undo(step)
            self._abort(exc)
            for step in batch:
                self._alone(step, counts)
            return
        counts[0] += 1
        self._observed(began, len(batch))
        self._finish([(step, result, None) for step, result in zip(batch, results, strict=True)])

    def _alone(self, step: _Step, counts: list[int]) -> None:
        """Run a step outside any batch: each of its writes commits on its own, so a backend's
        own fault handling (a full-text index failing open) applies as it does without a
        writer."""
        began = time.perf_counter()
        try:
            result = self._execute(step, counts)
        except BaseException as exc:  # noqa: BLE001 - handed to the step's caller
            self._undo(step)
            self._abort(exc)
            self._finish([(step, None, exc)])
            return
        counts[0] += 1
        self._observed(began, 1)
        self._finish([(step, result, None)])

    def _observed(self, began: float, steps: int) -> None:
        if self._observe is not None:
            try:
                self._observe(time.perf_counter() - began, steps)
            except Exception:  # an observer never breaks a commit
                logger.exception("a commit observer failed")

    def _execute(self, step: _Step, counts: list[int]) -> Any:
        self._local.step = step
        try:
            return step.run()
        finally:
            self._local.step = None
            counts[1] += 1

    @staticmethod
    def _undo(step: _Step) -> None:
        step.deferred.clear()
        for callback in reversed(step.undo):
            try:
                callback()
            except Exception:
                logger.exception("undoing a rolled-back store step failed")
        step.undo.clear()

    def _abort(self, error: BaseException) -> None:
        logger.debug("a store write batch was rolled back: %s", error)
        try:
            self._on_abort()
        except Exception:
            logger.exception("resetting the store after a failed write failed")

    @staticmethod
    def _finish(outcomes: list[tuple[_Step, Any, BaseException | None]]) -> None:
        """Run the committed steps' deferred work and hand every caller its outcome: one
        wake-up per event loop for the whole batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None]]]
        by_loop = {}
        for step, result, error in outcomes:
            if error is None:
                for callback in step.deferred:
                    try:
                        callback()
                    except Exception:
                        logger.exception("a callback after a store commit failed")
            if step.loop is None:
                _settle(step.future, result, error)
            else:
                by_loop.setdefault(step.loop, []).append((step.future, result, error))
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, settled)
            except RuntimeError:  # the loop is closed: nobody awaits these any more
                logger.debug("a store step finished after its event loop closed")


def _settle(future: Any, result: Any, error: BaseException | None) -> None:
    if future.done():  # an awaiting coroutine was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _settle_all(settled: list[tuple[Any, Any, BaseException | None]]) -> None:
    for future, result, error in settled:
        _settle(future, result, error)
