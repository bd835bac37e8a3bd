"""The background writer: one save in flight at a time, on a thread of its own.

Training hands a snapshot over and continues; the write, the hashing and the commit run here.
A second save waits for the first (its error, if any, is raised to whoever waits), and loads
settle here first because they reuse the staging buffers a background save may still read.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["AsyncRunner"]

T = TypeVar("T")


class AsyncRunner(Generic[T]):
    """Runs one job at a time in the background and remembers the one in flight."""

    def __init__(self, thread_name: str = "ckptkeeper-save") -> None:
        self._thread_name = thread_name
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[T] | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Start ``job`` in the background (call :meth:`wait` first: one job at a time)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        fut = self._executor.submit(job)
        with self._lock:
            self._inflight = fut
        return fut

    @property
    def in_flight(self) -> bool:
        """Whether a job has not finished yet."""
        with self._lock:
            return self._inflight is not None and not self._inflight.done()

    def wait(self) -> T | None:
        """Wait for the job in flight, if any, and forget it; re-raises its error."""
        with self._lock:
            fut, self._inflight = self._inflight, None
        return fut.result() if fut is not None else None

    def forget(self, fut: Future[T]) -> None:
        """Stop tracking ``fut`` when it is the job in flight: its outcome was collected elsewhere."""
        with self._lock:
            if self._inflight is fut:
                self._inflight = None

    def settle(self) -> None:
        """Wait for the job in flight to finish, leaving its outcome with its future."""
        with self._lock:
            fut = self._inflight
        if fut is not None:
            concurrent.futures.wait([fut])

    def close(self) -> None:
        """Wait for the job in flight (re-raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
