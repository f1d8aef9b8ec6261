"""The server's queue: requests wait here, bounded, and one thread decodes those that arrived together in one
batch (sampling.decode_together), so that concurrent clients share each forward pass.

| choice                 | why                                                                             |
|------------------------|---------------------------------------------------------------------------------|
| one decoding thread    | the model is one; torch uses every core for each forward pass already; serve   |
|                        | decodes on the main thread (`run`): torch's int8 kernels measured 2.5x slower   |
|                        | called from any other (RESULTS.md)                                              |
| a batch per round      | rows join when a round starts, none mid-round: a round's rows share one padded   |
|                        | prompt; the next round takes what came meanwhile                                |
| GATHER_QUIET, _LONGEST | a round starts once no request has come for GATHER_QUIET seconds (clients that   |
|                        | arrive together are decoded together), GATHER_LONGEST at most, or when full      |
| a bounded queue        | a full queue is refused at once (serving.py: 429), never grows memory           |
| cancel                 | a job gone before its round is skipped and frees its place at once; one gone     |
|                        | during its round stops its rows at the next token                               |
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from .sampling import Row

logger = logging.getLogger("lowmem_aitextgen")

GATHER_QUIET, GATHER_LONGEST = 0.03, 0.1  # seconds; a 355M token takes 0.03 (batch 1) to 0.05 (batch 8)
STOP = object()  # put in the queue by Batcher.stop


class Stopping(RuntimeError):
    """What a job still waiting or decoding is answered with when the server stops."""


class Job:
    """One request's rows, and whether it waits, runs, or is over."""

    def __init__(self, rows: list[Row], on_done: Callable[[BaseException | None], None]) -> None:
        self.rows, self.on_done = rows, on_done
        self.state = "queued"  # "running", "cancelled", "done"
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Queued -> running; False where it was cancelled meanwhile."""
        with self._lock:
            if self.state != "queued":
                return False
            self.state = "running"
            return True

    def cancel(self) -> bool:
        """Its client is gone or its time is up: its rows stop; True where it had not started (its place in
        the queue is free now)."""
        with self._lock:
            was_queued = self.state == "queued"
            if self.state in ("queued", "running"):
                self.state = "cancelled"
            for row in self.rows:
                row.cancelled.set()
            return was_queued

    def finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self.state == "running":
                self.state = "done"
        self.on_done(error)


class Batcher:
    """Jobs in, rounds of at most `max_rows` rows that `fits` (the server: padded to the longest prompt, within
    the context) decoded by `decode` on one thread; at most `limit` jobs waiting."""

    def __init__(self, decode: Callable[[list[Row]], None], max_rows: int, limit: int,
                 fits: Callable[[list[Row]], bool] = lambda rows: True) -> None:
        self.decode, self.max_rows, self.limit, self.fits = decode, max_rows, limit, fits
        self._queue: queue.Queue = queue.Queue()
        self._waiting = 0
        self.running_rows = 0  # in the round being decoded
        self.decoded_rows = 0  # in every round so far
        self._lock = threading.Lock()
        self._held: object = None  # taken from the queue but not fitting the round: first in the next
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Decoding on a thread of its own (`run` decodes on the caller's)."""
        self._thread = threading.Thread(target=self.run, name="lowmem_aitextgen decoding", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """`run` returns once its round is over; the jobs still queued are answered with an error."""
        self._queue.put(STOP)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, job: Job) -> bool:
        """Queued, or False where `limit` jobs already wait."""
        with self._lock:
            if self._waiting >= self.limit:
                return False
            self._waiting += 1
        self._queue.put(job)
        return True

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet in a round."""
        return self._waiting

    def cancel(self, job: Job) -> None:
        if job.cancel():
            self._left_queue()

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting -= 1

    def run(self) -> None:
        """Rounds until `stop`; then every job still waiting is answered with an error."""
        try:
            while True:
                first, self._held = self._held or self._queue.get(), None
                if first is STOP:
                    return
                self._round(self._gather(first))
        finally:
            self._turn_away()

    def _turn_away(self) -> None:
        waiting = [self._held] if isinstance(self._held, Job) else []
        while not self._queue.empty():
            waiting.append(self._queue.get_nowait())
        for job in waiting:
            if isinstance(job, Job) and job.start():
                job.finish(Stopping("the server is stopping"))

    def _gather(self, first: Job) -> list[Job]:
        """`first` and the jobs that come with it, as many as fit in one round: until none has come for
        GATHER_QUIET (GATHER_LONGEST at most); the one that does not fit, or the stop, is held for the next."""
        jobs, rows = [first], list(first.rows)
        deadline = time.monotonic() + GATHER_LONGEST
        while len(rows) < self.max_rows and time.monotonic() < deadline:
            try:
                job = self._queue.get(timeout=min(GATHER_QUIET, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
            if job is STOP or len(rows) + len(job.rows) > self.max_rows or not self.fits(rows + job.rows):
                self._held = job
                break
            jobs.append(job)
            rows += job.rows
        return jobs

    def _round(self, jobs: list[Job]) -> None:
        started = []
        for job in jobs:
            if job.start():
                self._left_queue()
                started.append(job)
        if not started:
            return
        rows = [row for job in started for row in job.rows]
        self.running_rows, self.decoded_rows, error = len(rows), self.decoded_rows + len(rows), None
        try:
            self.decode(rows)
        except Exception as failure:  # answered to each client (500), the server goes on
            logger.exception("Decoding a batch failed")
            error = failure
        except BaseException:  # Ctrl-C: each client answered (503), then it goes on up
            for job in started:
                job.finish(Stopping("the server is stopping"))
            raise
        self.running_rows = 0
        for job in started:
            job.finish(error)
