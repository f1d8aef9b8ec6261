"""What the server is doing, for the people who run it: Prometheus metrics (GET /metrics, through
prometheus-client) and one access-log line a request (the logger `lowmem_aitextgen.access`), both kept by one
ASGI middleware that also turns an error no route answered into OpenAI's JSON error shape.

| metric                                        | kind      | what                                         |
|-----------------------------------------------|-----------|----------------------------------------------|
| lowmem_aitextgen_requests_total               | counter   | requests by route and status                 |
| lowmem_aitextgen_prompt_tokens_total          | counter   | prompt tokens of answered completions        |
| lowmem_aitextgen_completion_tokens_total      | counter   | tokens made for answered completions         |
| lowmem_aitextgen_queue_depth                  | gauge     | requests waiting to join the decoding        |
| lowmem_aitextgen_decoding_rows                | gauge     | texts decoding now                           |
| lowmem_aitextgen_time_to_first_token_seconds  | histogram | a completion's arrival to its first token    |
| lowmem_aitextgen_request_seconds              | histogram | a request's arrival to its last byte         |

A registry of its own per server (not prometheus-client's global one): two servers in one process (tests, an
app embedding it) count apart.  Routes are labelled by their path where the app has it, else "other": a
client sending random paths cannot grow the label set.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

access_logger = logging.getLogger("lowmem_aitextgen.access")
logger = logging.getLogger("lowmem_aitextgen")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """The server's metrics in a registry of their own; `queued()` and `rows()` read the batcher when scraped."""

    def __init__(self, queued: Callable[[], int], rows: Callable[[], int]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        name = "lowmem_aitextgen_"
        self.requests = Counter(name + "requests", "Requests by route and status", ("route", "status"),
                                registry=self.registry)
        self.prompt_tokens = Counter(name + "prompt_tokens", "Prompt tokens of answered completions",
                                     registry=self.registry)
        self.completion_tokens = Counter(name + "completion_tokens", "Tokens made for answered completions",
                                         registry=self.registry)
        Gauge(name + "queue_depth", "Requests waiting to join the decoding",
              registry=self.registry).set_function(queued)
        Gauge(name + "decoding_rows", "Texts decoding now", registry=self.registry).set_function(rows)
        self.first_token = Histogram(name + "time_to_first_token_seconds", "A completion's arrival to its first "
                                     "token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram(name + "request_seconds", "A request's arrival to its last byte",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def completed(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)


class Observed:
    """ASGI middleware: each HTTP request counted (route, status), timed, logged in one line (method, route,
    status, tokens made, milliseconds); an exception no route answered becomes a 500 in OpenAI's JSON shape
    (logged with its traceback through `logging`), never a bare text."""

    def __init__(self, app: Any, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, seen = time.perf_counter(), {"status": 500, "started": False}
        scope.setdefault("state", {})

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"], seen["started"] = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:  # a route's answer is its own; this is what none answered
            logger.exception("A request failed")
            if not seen["started"]:
                await _json_500(sending, error)
        finally:
            self._record(scope, seen["status"], time.perf_counter() - start)

    def _record(self, scope: dict, status: int, seconds: float) -> None:
        route = scope["path"] if scope["path"] in self.routes else "other"
        self.metrics.requests.labels(route, str(status)).inc()
        self.metrics.latency.observe(seconds)
        tokens = scope["state"].get("completion_tokens", "-")
        access_logger.info('%s %s %d %s tokens %.0f ms', scope["method"], route, status, tokens, seconds * 1000)


async def _json_500(send: Callable, error: Exception) -> None:
    body = json.dumps({"error": {"message": f"The server failed: {type(error).__name__}; it goes on, retry the "
                                            "request.", "type": "server_error", "param": None, "code": None}})
    await send({"type": "http.response.start", "status": 500,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body.encode()})
