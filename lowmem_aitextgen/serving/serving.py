"""`lowmem_aitextgen serve`: a trained model behind OpenAI's completions API and a page, on Starlette and
uvicorn (the optional extra `serve`).

| route                | what                                                                        |
|----------------------|-----------------------------------------------------------------------------|
| POST /v1/completions | completions.py's fields; batched (batching.py), streamed as server-sent events |
| GET /v1/models       | the served model, with its decoding plan                                    |
| GET /health          | up, and what is queued, decoding, cancelled so far (a load balancer's check) |
| GET /metrics         | Prometheus' text format (server_metrics.py)                                 |
| GET /                | the page (page.html): a prompt box, the usual settings, the text as it comes |
| /v1/chat/completions | 400 naming it: a GPT-2 fine-tune has no chat template                       |

Bounded: a body over MAX_BODY bytes, malformed JSON and every wrong field answer 400 naming the field; a full
queue 429 with Retry-After at once; a request past --timeout 504, its rows stopped; a client gone mid-stream
stops its rows.  Every error is OpenAI's JSON error shape (unknown routes 404, wrong methods 405).  With
--api-key every /v1 request needs `Authorization: Bearer KEY` (compared in constant time).  Nothing a request
sends names a file: the model is chosen when the server starts.

Stopping: SIGTERM stops taking connections, answers the requests queued (and any arriving meanwhile) 503 at once,
gives the texts being decoded --shutdown_timeout seconds to end (a stream cut then ends with an error event, a
request 503: a load balancer retries it elsewhere), and exits 0 within a few seconds of that; Ctrl-C ends at
once, answering what is in flight 503.
The port is bound before the model is read and held from then on: a port lost, even in a race with another
server, ends the process (status 2) with one line naming host and port.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .. import _compat
from ..generation.decoding import context_length
from ..generation.engine import Engine
from ..generation.sampling import Row
from . import completions
from .batching import Batcher, Job, Stopping
from .completions import ApiError, CompletionRequest, Limits
from .server_metrics import Metrics, Observed

logger = logging.getLogger("lowmem_aitextgen")

INSTALL_SERVE = 'pip install "lowmem_aitextgen[serve]" (Starlette and uvicorn)'
MAX_BODY = 1 << 20  # bytes: a request is a prompt and a few settings
RETRY_AFTER_SECONDS = 1
# How often a waiting request looks whether its client is still there: each look takes the GIL from the
# decoding for a moment, and at 0.1 s eight waiting clients slowed a round by a third (RESULTS.md).
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class ServeSettings:
    """serve's flags, checked before the model is read (check)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_tokens: int = 256
    max_batch: int = 8
    queue: int = 64
    timeout: float = 60.0
    cors: str | None = None  # origins a browser page may call from, comma-separated ("*": any); None: no CORS
    threads: int | None = None  # CPU threads the decoding uses; None: torch's own (one a core)
    shutdown_timeout: float = 10.0  # after SIGTERM: seconds the texts decoding have to end (a platform's grace: 30)

    def check(self) -> None:
        for name, low in (("max_tokens", 1), ("max_batch", 1), ("queue", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name}={value!r}: must be a whole number of at least {low}.")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port={self.port!r}: must be a port number from 1 to 65535 (0: any free port).")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"--threads={self.threads!r}: must be a whole number of at least 1 (replicas on one "
                             "machine: its cores divided among them); leave it out for one a core.")
        for name in ("timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"--{name}={value!r}: must be a number of seconds above 0.")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"--host={self.host!r}: must be an address to bind, e.g. 127.0.0.1.")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("--api_key: must be a non-empty text; leave it out to serve without one.")
        if self.cors is not None and (not isinstance(self.cors, str) or not self.origins()):
            raise ValueError(f"--cors={self.cors!r}: must be origins separated by commas, e.g. "
                             "https://example.org,http://localhost:3000, or * for any.")
        for package in ("starlette", "uvicorn", "prometheus_client"):
            if not _compat.importable(package):
                raise ValueError(f"serve needs {package}, which is not installed: {INSTALL_SERVE}.")

    def take_threads(self) -> None:
        """--threads for this process's torch. Replicas sharing cores each with one thread a core made the
        threads of one wait on those of another: six requests took 8 s, and at times past --timeout, where a
        thread each took 2.5 s (benchmarks/HISTORY.md, "Replicas on one machine")."""
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)

    def origins(self) -> list[str]:
        return [origin.strip() for origin in (self.cors or "").split(",") if origin.strip()]

    def listen(self) -> Any:
        """The listening socket, bound now (before the model is read) and held until the server ends: no other
        process can take the port in between."""
        import socket

        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
            listening = socket.socket(family, socket.SOCK_STREAM)
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            listening.bind((self.host, self.port))
            listening.listen(2048)
        except OSError as error:
            reason = error.strerror or str(error)
            raise ValueError(f"--host={self.host!r} --port={self.port}: cannot listen there ({reason}); choose "
                             "another port, or stop what listens on it.") from None
        return listening


class Server:
    """What the routes share: the model in its serving form, the tokenizer, the limits and the queue."""

    def __init__(self, ai: Any, model_id: str, settings: ServeSettings) -> None:
        self.model, self.plan = ai.serving_model()
        self.tokenizer, self.settings, self.shape = ai.tokenizer, settings, ai.model_shape
        context = context_length(self.shape)
        rows = min(settings.max_batch, self.plan.max_rows or settings.max_batch)
        self.limits = Limits(model_id, context, min(settings.max_tokens, context), rows,
                             self.shape.get_input_embeddings().num_embeddings)
        eos = () if ai.tokenizer.eos_token_id is None else (ai.tokenizer.eos_token_id,)
        # each request's rows within the context (CompletionRequest.rows), so no row's window slides: a text is the one alone
        self.batcher = Batcher(lambda: Engine(self.model, self.tokenizer, eos), rows, settings.queue)
        self.cancelled_rows = {"client left": 0, "timed out": 0}
        self.created = int(time.time())
        self.metrics = Metrics(lambda: self.batcher.waiting, lambda: self.batcher.running_rows)

    def encode(self, prompt: str, prepend_bos: bool) -> Any:
        """A text prompt's ids: the tokens the text makes, after the start-of-text token only where asked or where
        the text is empty (completions.first_token: one rule for text and token ids, whatever the model's
        training: a client scores and continues exactly the tokens its text makes)."""
        from ..generation.generation import prompt_ids

        return prompt_ids(self.shape, self.tokenizer, prompt, completions.first_token(prompt, prepend_bos))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def authorized(self, header: str | None) -> bool:
        if self.settings.api_key is None:
            return True
        expected = f"Bearer {self.settings.api_key}".encode()
        return hmac.compare_digest((header or "").encode(), expected)


# --- the app -------------------------------------------------------------------------------


def make_app(server: Server) -> Any:
    """The Starlette app over `server`: its routes, every error in OpenAI's shape, CORS where --cors asks, each
    request observed (server_metrics.Observed); its shutdown ends the decoding loop."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        yield
        server.batcher.stop()  # the decoding loop (serve: the main thread's) ends

    routes = _routes(server)
    paths = tuple(route.path for route in routes)
    middleware = [Middleware(Observed, metrics=server.metrics, routes=frozenset(paths))]
    if server.settings.cors is not None:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=server.settings.origins(),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=_error_handlers(paths))


def _routes(server: Server) -> list[Any]:
    """The app's routes: the page, /health, /metrics, /v1/models, /v1/completions, and the chat API's refusal."""
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    async def page(request: Any) -> HTMLResponse:
        return HTMLResponse(resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8"))

    async def health(request: Any) -> JSONResponse:
        batcher = server.batcher
        return JSONResponse({"status": "ok", "queued": batcher.waiting, "decoding_rows": batcher.running_rows,
                             "decoded_rows": batcher.decoded_rows, "cancelled_rows": server.cancelled_rows})

    async def metrics(request: Any) -> Response:
        body, content_type = server.metrics.exposition()
        return Response(body, media_type=content_type)

    async def models(request: Any) -> JSONResponse:
        _check_key(server, request)
        return JSONResponse({"object": "list", "data": [{
            "id": server.limits.model_id, "object": "model", "created": server.created,
            "owned_by": "lowmem_aitextgen", "plan": server.plan.describe()}]})

    async def complete(request: Any) -> Any:
        _check_key(server, request)
        return await _completion(server, request)

    async def chat(request: Any) -> Any:
        raise ApiError(400, "The chat API (/v1/chat/completions) is not served: a fine-tuned GPT-2 has no chat "
                            "template. Send the text as prompt to /v1/completions.", code="unsupported_endpoint")

    return [Route("/", page), Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["GET", "POST"])]


def _error_handlers(paths: tuple[str, ...]) -> dict[Any, Any]:
    """Every error in OpenAI's shape: ours (ApiError, a 429 with Retry-After) and Starlette's (an unknown route or
    method, naming the routes `paths`)."""
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse

    async def api_error(request: Any, error: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def http_error(request: Any, error: HTTPException) -> JSONResponse:
        what = {404: f"No route {request.url.path}; the routes are {', '.join(paths)}.",
                405: f"{request.method} is not taken by {request.url.path}; see docs/serve.md for its methods."}
        message = what.get(error.status_code, str(error.detail))
        return JSONResponse(ApiError(error.status_code, message).body(), status_code=error.status_code,
                            headers=error.headers)

    return {ApiError: api_error, HTTPException: http_error}


def _check_key(server: Server, request: Any) -> None:
    if not server.authorized(request.headers.get("authorization")):
        raise ApiError(401, "A valid API key is needed: send the header 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


async def _body(request: Any) -> bytes:
    """The body, refused (400) past MAX_BODY bytes without reading more of it."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
        raise ApiError(400, f"The body is larger than {MAX_BODY:,} bytes; send a shorter prompt.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(400, f"The body is larger than {MAX_BODY:,} bytes; send a shorter prompt.")
        chunks.append(chunk)
    return b"".join(chunks)


class _Flow:
    """One request's rows as the event loop sees them: their text pieces and their end, handed over from the
    decoding thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.pieces: asyncio.Queue = asyncio.Queue()
        self.done = asyncio.Event()
        self.moved = asyncio.Event()  # a first piece, or the end
        self.error: BaseException | None = None

    def on_text(self, k: int, piece: str) -> None:
        def arrived() -> None:
            self.pieces.put_nowait((k, piece))
            self.moved.set()
        self.loop.call_soon_threadsafe(arrived)

    def on_done(self, error: BaseException | None) -> None:
        def finished() -> None:
            self.error = error
            self.done.set()
            self.moved.set()
            self.pieces.put_nowait(None)  # wakes a stream waiting for a piece: its end is told at once
        self.loop.call_soon_threadsafe(finished)


async def _completion(server: Server, request: Any) -> Any:
    from starlette.responses import JSONResponse, StreamingResponse

    arrived = time.monotonic()
    asked = completions.parse(await _body(request), server.limits)
    flow = _Flow()
    # only a stream is told each piece: each telling wakes the event loop, which takes the GIL from decoding
    rows, prompts = asked.rows(server.encode, server.limits.context, flow.on_text if asked.stream else None,
                               server.tokenizer.bos_token_id)
    job = Job(rows, flow.on_done)
    try:
        queued = server.batcher.submit(job)
    except Stopping:
        raise ApiError(503, STOPPING, kind="server_error") from None
    if not queued:
        raise ApiError(429, f"The queue is full ({server.settings.queue} requests wait); retry in a moment.",
                       kind="rate_limit_error")
    deadline = arrived + server.settings.timeout
    prompt_tokens = sum(len(ids) for ids in prompts)
    if asked.stream:
        await _until(server, request, job, deadline, flow.moved)
        return StreamingResponse(_events(server, request, asked, job, flow, rows, prompt_tokens, arrived),
                                 media_type="text/event-stream")
    await _until(server, request, job, deadline, flow.done)
    _raise_failure(flow)
    _answered(server, request, rows, prompt_tokens, arrived)
    texts = [_prompt_text(server, prompt) for prompt in asked.prompts]
    choices = [completions.finished_choice(k, asked, row, texts[k // asked.n], server.decode)
               for k, row in enumerate(rows)]
    used = completions.usage(prompt_tokens, sum(len(row.tokens) for row in rows))
    return JSONResponse(completions.answer(asked, server.limits.model_id, choices, used))


def _prompt_text(server: Server, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else server.decode(prompt)


def _answered(server: Server, request: Any, rows: list[Row], prompt_tokens: int, arrived: float) -> None:
    """A completion's counts kept: the metrics', and its tokens for the access log's line."""
    made = sum(len(row.tokens) for row in rows)
    request.state.completion_tokens = made
    server.metrics.completed(prompt_tokens, made)
    firsts = [row.first_token_at for row in rows if row.first_token_at is not None]
    if firsts:
        server.metrics.first_token.observe(min(firsts) - arrived)


async def _until(server: Server, request: Any, job: Job, deadline: float, ready: asyncio.Event) -> None:
    """Waits until `ready` is set, the client leaves (its rows stopped) or the deadline (504, its rows
    stopped)."""
    while not ready.is_set():
        if time.monotonic() > deadline:
            _cancel(server, job, "timed out")
            raise ApiError(504, f"The request took longer than --timeout={server.settings.timeout:g} s; ask for "
                                "fewer tokens, or retry when the server is less busy.", kind="timeout_error")
        if await request.is_disconnected():
            _cancel(server, job, "client left")
            raise ApiError(499, "The client left.")
        try:
            await asyncio.wait_for(ready.wait(), timeout=max(0.01, min(POLL_SECONDS, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            continue


def _cancel(server: Server, job: Job, why: str) -> None:
    if job.state in ("queued", "running"):
        server.cancelled_rows[why] += len(job.rows)
        server.batcher.cancel(job)


STOPPING = "The server is stopping; retry on another, or once it is back."


def _raise_failure(flow: _Flow) -> None:
    if flow.error is not None:
        raise _failure(flow.error)


def _failure(error: BaseException) -> ApiError:
    """What a request whose decoding ended with `error` is answered: 503 where the server stops, else 500."""
    if isinstance(error, Stopping):
        return ApiError(503, STOPPING, kind="server_error")
    return ApiError(500, f"Decoding failed: {type(error).__name__}: {error}", kind="server_error")


async def _events(server: Server, request: Any, asked: CompletionRequest, job: Job, flow: _Flow, rows: list[Row],
                  prompt_tokens: int, arrived: float) -> Any:
    """The stream: a chunk per piece of text, then each choice's finish, the usage where asked, [DONE]; a
    client that leaves (the generator closed) or the deadline, pieces flowing or not, stops the rows (the
    deadline ends the stream with a timeout error; SIGTERM's drain ends it at --shutdown_timeout: Batcher.drain)."""
    model_id, deadline = server.limits.model_id, arrived + server.settings.timeout
    try:
        while not (flow.done.is_set() and flow.pieces.empty()):
            if time.monotonic() > deadline and not flow.done.is_set():  # (its text all made: all handed on)
                _cancel(server, job, "timed out")
                yield completions.event(ApiError(504, "The request took longer than --timeout.",
                                                 kind="timeout_error").body())
                return
            try:
                handed = await asyncio.wait_for(flow.pieces.get(), timeout=max(0.01, min(
                    POLL_SECONDS, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                continue
            if handed is None:  # the end (_Flow.on_done): after every piece
                continue
            k, piece = handed
            yield completions.event(completions.answer(asked, model_id, [completions.choice(k, piece, None)], None))
        if flow.error is not None:
            yield completions.event(_failure(flow.error).body())
            return
        _answered(server, request, rows, prompt_tokens, arrived)
        for k, row in enumerate(rows):
            yield completions.event(completions.answer(asked, model_id, [completions.choice(k, "", row.finish)],
                                                       None))
        if asked.include_usage:
            used = completions.usage(prompt_tokens, sum(len(row.tokens) for row in rows))
            yield completions.event(completions.answer(asked, model_id, [], used))
        yield completions.event("[DONE]")
    finally:
        _cancel(server, job, "client left")  # the generator closed mid-stream (nothing where the job is over)


# --- running it ----------------------------------------------------------------------------


def serve(ai: Any, model_id: str, settings: ServeSettings, listening: Any = None) -> None:
    """Serves on `listening` (ServeSettings.listen()'s socket; bound here where None) until SIGTERM (taken
    requests answered first) or Ctrl-C: uvicorn on a thread of its own, the decoding on this one (the main
    thread: torch's int8 kernels measured 2.5x slower from any other, batching.py)."""
    import uvicorn

    listening = listening if listening is not None else settings.listen()
    server = Server(ai, model_id, settings)
    logger.info(server.plan.describe())
    # SIGTERM's drain: uvicorn stops taking connections and waits for those taken, which the batcher answers
    # within --shutdown_timeout (Batcher.drain)
    runner = uvicorn.Server(uvicorn.Config(make_app(server), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout) + 2))
    _say_where_once_bound(runner, model_id)

    def run_http() -> None:
        try:
            runner.run(sockets=[listening])
        finally:
            server.batcher.stop()  # uvicorn ended (drained, or never started): so does the decoding loop

    serving = threading.Thread(target=run_http, name="lowmem_aitextgen http", daemon=True)
    serving.start()
    def on_sigterm(signum: int, frame: Any) -> None:
        server.batcher.drain(settings.shutdown_timeout)  # (sets a time: safe whatever this thread holds)
        runner.should_exit = True

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C stops it even where the shell started it ignoring SIGINT (a background job), as uvicorn's does
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.batcher.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)
        runner.should_exit = True
        serving.join(timeout=settings.shutdown_timeout + 5)
        listening.close()
    if not runner.started:
        raise ValueError(f"--host={settings.host!r} --port={settings.port}: the server could not start there; "
                         "see the lines above.")


def _say_where_once_bound(runner: Any, model_id: str) -> None:
    """One line with the address, printed once uvicorn has bound its socket (--port=0: the port it got)."""
    startup = runner.startup

    async def started(sockets: Any = None) -> None:
        await startup(sockets)
        host, port = runner.servers[0].sockets[0].getsockname()[:2]
        print(f"Serving {model_id} at http://{host}:{port}/ (the page) and /v1 (OpenAI's completions API); "
              "Ctrl-C stops.", flush=True)

    runner.startup = started
