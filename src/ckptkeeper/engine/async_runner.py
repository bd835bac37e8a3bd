"""The background writer: one save in flight at a time, on a thread of its own.

Training hands a snapshot over and continues; the write, the hashing and the commit run here.
A second save waits for the first (its error, if any, is raised to whoever waits), and loads
settle here first because they reuse the staging buffers a background save may still read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from ..errors import ConfigurationError

__all__ = ["AsyncRunner", "ctrl_c_held", "is_outcome"]

T = TypeVar("T")

log = logging.getLogger("ckptkeeper.engine.checkpointer")


@contextlib.contextmanager
def ctrl_c_held(on_first: Callable[[], None] | None = None) -> Iterator[list[int]]:
    """Ctrl-C arriving inside the block is raised as it ends (in the main thread, where Python
    raises it, and only while SIGINT has Python's default handler: anyone else's stays in charge).
    With ``on_first`` (called at the first), a second Ctrl-C is raised at once. The block gets a
    list that is not empty once a Ctrl-C was held (always empty where none is held).

    Handing a job to the writer thread and recording it must happen together: interrupted in
    between, a save would run with nothing waiting for it (found by an outside attack).
    """
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    try:
        held = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    except (ValueError, AttributeError):  # pragma: no cover - no signals here
        held = False
    if not held:
        yield caught
        return

    def note(signum: int, frame: Any) -> None:
        if caught and on_first is not None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        caught.append(signum)
        if on_first is not None:
            on_first()

    signal.signal(signal.SIGINT, note)
    try:
        yield caught
    except BaseException as exc:
        # A Ctrl-C held while the block failed still stops the caller: raised as the error was,
        # a restore went on to the next checkpoint as if it had not been pressed.
        if caught and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        raise
    finally:
        # Put back only our own change: a handler installed meanwhile (by a signal handler that
        # ran inside the block) is somebody's choice.
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


class AsyncRunner(Generic[T]):
    """Runs one job at a time in the background and remembers the one in flight.

    Two things are tracked apart: which jobs' outcomes nobody has collected yet (:meth:`wait`
    collects and re-raises the last job's, :meth:`forget` drops one) and the last job started,
    until it has finished, whoever collected its outcome. :meth:`settle` and :attr:`in_flight` go by the
    second: a job whose outcome was dropped (an interrupted wait, a caller that forgot it) still
    reads its staging buffers until it ends (found by an outside attack: a load after Ctrl-C in
    ``wait()`` backed up into buffers a save was still writing from).
    """

    def __init__(self, thread_name: str = "ckptkeeper-save") -> None:
        self._thread_name = thread_name
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future[T] | None = None  # started last; may still be running
        self._waiting: dict[int, Future[T]] = {}  # the job each thread's outermost wait is for
        self._uncollected: set[Future[T]] = set()  # jobs whose outcome nobody has taken yet
        # Re-entrant: a signal handler may wait (close()) while its thread holds the lock.
        self._lock = threading.RLock()
        self._inside = threading.local()  # ``writer`` is set on the writer thread, for good

    def refuse_inside(self, what: str) -> None:
        """Raise :class:`ConfigurationError` when called on this runner's writer thread (inside a
        job, as a save's ``on_stage`` hook is, or in a done-callback of its future), where ``what``
        would wait for that thread to be free: a deadlock (found by outside attacks). The error
        fails that job instead and reaches whoever waits for it. Callers that change anything
        check before they do."""
        # Also after a job has returned: its future's done-callbacks run on the writer thread too,
        # where waiting for the writer (settle's drain, the next save) waits for ever as well.
        if getattr(self._inside, "writer", False):
            raise ConfigurationError(
                f"{what} was called inside a background save, on its own writer thread (from an on_stage "
                "hook, or a done-callback of a save's future?), where it would wait for that thread to be free, "
                "for ever; call it from the training code"
            )

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Start ``job`` in the background (call :meth:`wait` first: one job at a time)."""
        self.refuse_inside("starting another background save")
        inside = self._inside
        recorded = threading.Event()

        def run() -> T:
            inside.writer = True
            # Not before the job is recorded as the one in flight: a hook's wait() in between
            # found none and went on without refusal (found by a flaky test under load).
            recorded.wait()
            return job()

        with ctrl_c_held():
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
            try:
                fut = self._executor.submit(run)
                with self._lock:
                    self._last = fut
                    self._uncollected.add(fut)
            finally:
                # Whatever happened here (a signal handler raising inside submit(), after the job
                # was queued, say): the writer must never wait for ever.
                recorded.set()
        return fut

    @property
    def in_flight(self) -> bool:
        """Whether a job has not finished yet (whether or not its outcome was collected)."""
        with self._lock:
            return self._last is not None and not self._last.done()

    def wait(self, what: str = "wait()") -> T | None:
        """Wait for the job in flight, if any, and forget it; re-raises its error.

        Interrupted while waiting (Ctrl-C), the job stays the one in flight: its outcome is
        collected by the next wait.
        """
        with self._lock:
            fut = self._last
            if fut not in self._uncollected:
                return None  # none started, or its outcome was collected
        return self.wait_for(fut, what)

    def wait_for(self, fut: Future[T], what: str = "wait_for()") -> T | None:
        """Wait for ``fut`` (a job of this runner); its result, or its error raised.

        A job's error (or cancellation) is raised once in all: by the waiter that collects it
        while it is the job in flight; any other waiter gets None. Of waits nested in one thread
        (a signal handler's ``wait()`` or ``close()`` while this thread waited) the outermost
        collects, so the error reaches the code that was waiting whatever the handler does.
        Interrupted while waiting (Ctrl-C), the job stays in flight. Refused (see
        :meth:`refuse_inside`) only where it would block: a finished job's outcome is collected
        from anywhere.
        """
        if not fut.done():
            self.refuse_inside(what)
        me = threading.get_ident()
        with self._lock:
            outer = self._waiting.get(me)
            nested = outer is fut
            if not nested:
                self._waiting[me] = fut
        try:
            try:
                result = fut.result()
            except BaseException as exc:
                if is_outcome(fut, exc):
                    if not nested and self._collect(fut):
                        raise  # the job's own outcome, reported here once
                    if nested:
                        # Left to the wait this handler interrupted; logged too, in case the
                        # handler never returns there (it exits, say).
                        log.error("the background save failed (%s); raised by the wait this handler interrupted", exc)
                    return None
                raise  # interrupted while waiting: the job stays in flight
            if not nested:
                self._collect(fut)
            return result
        finally:
            if not nested:
                with self._lock:
                    if outer is None:
                        self._waiting.pop(me, None)
                    else:
                        self._waiting[me] = outer

    def _collect(self, fut: Future[T]) -> bool:
        """Mark ``fut``'s outcome collected; whether this call did (and so reports it)."""
        with self._lock:
            if fut in self._uncollected:
                self._uncollected.discard(fut)
                return True
            return False

    def forget(self, fut: Future[T]) -> None:
        """Stop tracking ``fut``'s outcome when it is the job in flight: it was collected elsewhere.

        :meth:`settle` still waits for it while it runs."""
        with self._lock:
            self._uncollected.discard(fut)

    def settle(self) -> None:
        """Wait for every job started to finish, leaving their outcomes with their futures."""
        # From inside a job even the drain below would wait for ever (the one writer is busy).
        self.refuse_inside("waiting for the background save to end (a load does)")
        with self._lock:
            fut, executor = self._last, self._executor
        if fut is not None:
            concurrent.futures.wait([fut])
        if executor is not None:
            # The writer runs one job at a time, in order: once a no-op queued now has run, so has
            # anything queued before it, tracked or not (a job handed over as something other than
            # Ctrl-C interrupted the caller).
            with contextlib.suppress(RuntimeError):  # shut down meanwhile: nothing runs
                executor.submit(_nothing).result()

    def close(self) -> None:
        """Wait for the job in flight (re-raising its error) and stop the thread."""
        self.refuse_inside("close()")
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _nothing() -> None:
    return None


def is_outcome(fut: Future[Any], exc: BaseException) -> bool:
    """Whether ``exc``, raised while waiting for ``fut``, is the job's own outcome (its error or
    its cancellation) rather than an interruption of the wait (Ctrl-C)."""
    return fut.done() and (fut.cancelled() or fut.exception() is exc)
