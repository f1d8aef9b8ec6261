"""The server's queue: requests wait here, bounded, and one thread decodes them continuously in the batch
engine (engine.py): a request joins the running rows at the next decoding step and each row leaves the moment
it ends, so a short request never waits for the longest one in flight.

| choice                 | why                                                                             |
|------------------------|---------------------------------------------------------------------------------|
| one decoding thread    | the model is one; torch uses every core for each forward pass already; serve   |
|                        | decodes on the main thread (`run`): torch's int8 kernels measured 2.5x slower   |
|                        | called from any other (RESULTS.md)                                              |
| continuous batching    | the requests waiting join at the next step (their prompts computed within it,   |
|                        | beside the running rows' tokens: Engine.admit; the running rows' caches kept),  |
|                        | up to `max_rows` rows; a row that ends leaves at once, and its request is       |
|                        | answered when its last row has                                                  |
| a bounded queue        | a full queue is refused at once (serving.py: 429), never grows memory           |
| cancel                 | a job gone before it joins is skipped and frees its place at once; one gone     |
|                        | while decoding stops its rows at the next token                                 |
| a failed step          | every running request (those joining in it too) is answered with the error     |
|                        | (500), the engine starts empty, and the server goes on                          |
| rows let go unfinished | (an engine's fault) their request answered with an error (500) and logged:     |
|                        | never waited for, which kept the loop stepping an empty engine for ever         |
| draining (SIGTERM)     | no job joins any more: those queued and those submitted later are answered      |
|                        | Stopping at once (503); the running ones decode until they end or the drain's   |
|                        | deadline, when they are answered Stopping; then `run` returns                   |
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ..generation.engine import Engine
from ..generation.sampling import Row

logger = logging.getLogger("lowmem_aitextgen")

STOP = object()  # put in the queue by Batcher.stop
WAKE_SECONDS = 0.25  # how often a loop waiting for a job looks whether a drain began (set from a signal handler)


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
    """Jobs in; their rows decoded continuously, at most `max_rows` at once, in the engine `new_engine` makes
    (engine.Engine), on one thread; at most `limit` jobs waiting."""

    def __init__(self, new_engine: Callable[[], Engine], max_rows: int, limit: int) -> None:
        self.new_engine, self.max_rows, self.limit = new_engine, max_rows, limit
        self._queue: queue.Queue = queue.Queue()
        self._waiting = 0
        self.running_rows = 0  # decoding now
        self.decoded_rows = 0  # every row that has joined so far
        self._lock = threading.Lock()
        self._held: object = None  # taken from the queue but not fitting beside the running rows: first next
        self._thread: threading.Thread | None = None
        self.drain_until: float | None = None  # time.monotonic() by which the running jobs are answered (drain)

    def start(self) -> None:
        """Decoding on a thread of its own (`run` decodes on the caller's)."""
        self._thread = threading.Thread(target=self.run, name="lowmem_aitextgen decoding", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """`run` returns at its next step; the jobs still queued or decoding are answered with an error."""
        self._queue.put(STOP)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def drain(self, seconds: float) -> None:
        """No job joins from now on; the running ones have `seconds` to end (module docstring).  Only sets a time, so
        that a signal handler may call it whatever the thread it interrupts holds."""
        self.drain_until = time.monotonic() + seconds

    @property
    def draining(self) -> bool:
        return self.drain_until is not None

    def submit(self, job: Job) -> bool:
        """Queued, or False where `limit` jobs already wait; Stopping raised where the server drains."""
        if self.draining:
            raise Stopping("the server is stopping")
        with self._lock:
            if self._waiting >= self.limit:
                return False
            self._waiting += 1
        self._queue.put(job)
        return True

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet decoding."""
        return self._waiting

    def cancel(self, job: Job) -> None:
        if job.cancel():
            self._left_queue()

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting -= 1

    def run(self) -> None:
        """Steps until `stop`: before each, the jobs waiting join while their rows fit; after it, each job whose
        rows have all ended is answered.  Then every job still waiting or decoding is answered with an error."""
        engine, running = self.new_engine(), []
        try:
            while self._admit(engine, running) and not (self.draining and (
                    not running or time.monotonic() >= self.drain_until)):
                if running:
                    running = self._step(engine, running)
        except BaseException:  # Ctrl-C: each client answered (503), then it goes on up
            self._answer(running, Stopping("the server is stopping"))
            running = []
            raise
        finally:
            engine.close()
            self._answer(running, Stopping("the server is stopping"))
            self.running_rows = 0
            self._turn_away()

    def _admit(self, engine: Engine, running: list[Job]) -> bool:
        """The jobs waiting joined while their rows fit beside the running ones (waiting for one where none
        runs), their prompts encoded together; False once `stop` is taken."""
        joining: list[Job] = []
        if self.draining:
            self._turn_away()
            return True
        try:
            going = self._take(engine, running, joining)
            self._join(engine, running, joining)
        except BaseException:  # Ctrl-C meanwhile: the jobs taken and not joined are answered too
            self._answer([job for job in joining if job not in running], Stopping("the server is stopping"))
            raise
        return going

    def _take(self, engine: Engine, running: list[Job], joining: list[Job]) -> bool:
        """Into `joining`, the jobs waiting whose rows fit; False once `stop` is taken."""
        while True:
            if self._held is not None:
                job, self._held = self._held, None
            else:
                try:  # waiting for a job, woken now and then to see a drain begin
                    job = self._queue.get(block=not (running or joining), timeout=WAKE_SECONDS)
                except queue.Empty:
                    return True
            if job is STOP:
                return False
            if (running or joining) and engine.held + sum(len(j.rows) for j in joining) + len(job.rows) > \
                    self.max_rows:
                self._held = job
                return True
            if job.start():
                self._left_queue()
                joining.append(job)

    def _join(self, engine: Engine, running: list[Job], joining: list[Job]) -> None:
        """`joining`'s rows into the engine: their prompts computed together within the next step (Engine.admit),
        or encoded now where the engine joins them at once; where that fails, each job alone, so a job whose
        prompts cannot be encoded is answered with its error and the others still join.  The running rows are
        untouched where encoding now fails."""
        if not joining:
            return
        try:
            engine.admit([row for job in joining for row in job.rows])
            joined = joining
        except Exception:
            joined = []
            for job in joining:
                try:
                    engine.join(job.rows)
                    joined.append(job)
                except Exception as failure:
                    logger.exception("Encoding a request's prompts failed")
                    job.finish(failure)
        running.extend(joined)
        self.decoded_rows += sum(len(job.rows) for job in joined)
        self.running_rows = engine.held

    def _step(self, engine: Engine, running: list[Job]) -> list[Job]:
        """One decoding step; the jobs whose rows have all ended answered, and those whose unfinished rows the
        engine let go (module docstring); a failed step answers every running job with its error (500) and
        empties the engine, and the server goes on."""
        try:
            engine.step()
        except Exception as failure:
            logger.exception("Decoding a batch failed")
            engine.close()
            self._answer(running, failure)
            return []
        done = [job for job in running if all(row.finish is not None for row in job.rows)]
        self._answer(done, None)
        going = [job for job in running if job not in done]
        lost = _let_go(engine, going)
        if lost:  # a fault of the engine's: answered (500), not waited for by a loop that no longer blocks
            logger.error(f"The engine let {len(lost)} request(s)' rows go unfinished; answered with an error")
            self._answer(lost, RuntimeError("decoding let this request's rows go before they ended"))
        self.running_rows = engine.held
        return [job for job in going if job not in lost]

    @staticmethod
    def _answer(jobs: list[Job], error: BaseException | None) -> None:
        for job in jobs:
            job.finish(error)

    def _turn_away(self) -> None:
        """Every job waiting answered Stopping (503)."""
        waiting = [self._held] if isinstance(self._held, Job) else []
        self._held = None
        while not self._queue.empty():
            waiting.append(self._queue.get_nowait())
        for job in waiting:
            if isinstance(job, Job) and job.start():
                self._left_queue()
                job.finish(Stopping("the server is stopping"))


def _let_go(engine: Engine, jobs: list[Job]) -> list[Job]:
    """The jobs none of whose unfinished rows the engine holds (running or admitted): nothing would end them."""
    held = {id(row) for row in engine.rows + engine.joining}
    return [job for job in jobs if not any(id(row) in held for row in job.rows if row.finish is None)]
