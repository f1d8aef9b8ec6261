"""`serve` for the tools and people who run it: the evaluation protocol (logprobs, echo, max_tokens=0, token-id
prompts) through the real `openai` client and through lm-evaluation-harness itself, /metrics read by
prometheus-client's own parser, errors in OpenAI's shape, the port held from the start, CORS, the access log.
The real server (the CLI, in its own process, on a free port); tiny models on the CPU."""

import json
import math
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from test_serving import model_folder, start_server, stop_server

from lowmem_aitextgen import aitextgen
from lowmem_aitextgen.generation.forms import FORM_RECORDS

NOT_AT_THE_EDGES = "the server's protocol; the model's scores are test_engine's"
ORIGIN = "https://example.org"


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tokenizer_file):
    """A server without a key (as lm-eval runs against one), taking one web origin."""
    folder = model_folder(tmp_path_factory.mktemp("scored") / "model", n_positions=128)
    server = start_server(folder, tokenizer_file, "--max_tokens=100", "--max_batch=8", f"--cors={ORIGIN}")
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def scored_line_by_line(tmp_path_factory, tokenizer_file):
    """A server of a model trained line by line (its config says so: generate() starts it from start-of-text)."""
    from transformers import AutoConfig

    folder = model_folder(tmp_path_factory.mktemp("lines") / "model", n_positions=128)
    config = AutoConfig.from_pretrained(folder)
    config.line_by_line = True
    config.save_pretrained(folder)
    server = start_server(folder, tokenizer_file, "--max_tokens=100", "--max_batch=8")
    yield server
    stop_server(server.process)


@pytest.fixture(scope="module")
def truth(scored, tokenizer_file):
    """The saved model as read from its folder (fp32, its own forward), its tokenizer, and the bound of the
    form the server decodes in (forms.Form.score_error: logits; a log-probability moves at most twice that)."""
    ai = aitextgen(model_folder=scored.folder, tokenizer_file=tokenizer_file)
    form = ai.serving_model()[1].form
    return ai, 2 * FORM_RECORDS[form].score_error + 1e-4


def teacher_forced(ai, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token after the first: its log-probability under the model's forward, and the log-probabilities of
    every token at that place."""
    with torch.no_grad():
        logprobs = ai.model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], logprobs


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(scored, truth):
    """max_tokens=0 with echo and logprobs (lm-eval's request): the prompt back, each token after the first
    scored within the serving form's bound of the trained model's teacher-forced log-probabilities, the first
    null, the alternatives the model's likeliest."""
    ai, bound = truth
    prompt = "def main(): return the value of the first"
    made = scored.client(key="none").completions.create(model=scored.folder, prompt=prompt, max_tokens=0,
                                                         echo=True, logprobs=3, temperature=0)
    choice = made.choices[0]
    ids = ai.tokenizer(prompt)["input_ids"]
    expected, every = teacher_forced(ai, ids)
    assert choice.text == prompt and made.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == prompt and lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), expected, atol=bound)
    for place, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) == 3
        best = every[place].topk(3).values
        assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), best, atol=bound)


def test_logprobs_of_made_tokens_and_token_id_prompts(scored, truth):
    """Greedy tokens made with logprobs: each the model's log-probability of it after the prompt and the tokens
    before it; a prompt sent as token ids (and a list of such) answers as the same text does."""
    ai, bound = truth
    prompt = "class Foo"
    ids = ai.tokenizer(prompt)["input_ids"]
    client = scored.client(key="none")
    as_text = client.completions.create(model=scored.folder, prompt=prompt, max_tokens=6, logprobs=1,
                                        temperature=0, extra_body={"min_length": 20})
    made = ai.tokenizer(as_text.choices[0].text)["input_ids"]
    expected, _ = teacher_forced(ai, ids + made)
    lp = as_text.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and lp.text_offset[0] == len(prompt)
    assert torch.allclose(torch.tensor(lp.token_logprobs), expected[len(ids) - 1:], atol=bound)
    as_ids = client.completions.create(model=scored.folder, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"min_length": 20})
    assert as_ids.choices[0].text == as_text.choices[0].text
    both = client.completions.create(model=scored.folder, prompt=[ids, ids[:1]], max_tokens=6, temperature=0,
                                     extra_body={"min_length": 20})
    assert both.choices[0].text == as_text.choices[0].text and len(both.choices) == 2


@pytest.mark.parametrize("body, says", [
    ({"logprobs": 6}, "logprobs=6"), ({"logprobs": -1}, "logprobs=-1"),
    ({"echo": True, "stream": True}, "echo with stream"), ({"logprobs": 1, "stream": True}, "logprobs with stream"),
    ({"prompt": [5, 1000]}, "token id 1000"), ({"prompt": []}, "not an empty list"),
    ({"prompt": [[1, 2], []]}, "empty list of token ids"), ({"prompt": [1, "a"]}, "not a mixture"),
    ({"prompt": list(range(100)), "max_tokens": 50}, "context of 128"),
    ({"prompt": "a \ud800 b"}, "cannot be encoded"),
])
def test_bad_protocol_requests_are_refused_in_openais_shape(scored, body, says):
    response = httpx.post(f"{scored.url}/v1/completions", timeout=30,
                          content=json.dumps({"model": scored.folder, "prompt": "a", **body}).encode(),
                          headers={"Content-Type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and says in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] in ("prompt", "logprobs", "echo", "max_tokens")


def test_every_error_is_openais_json_with_its_status_and_no_traceback(scored):
    cases = [("GET", "/v1/nothing", 404, "No route /v1/nothing"), ("GET", "/v1/completions", 405, "GET is not"),
             ("POST", "/v1/chat/completions", 400, "chat API"), ("DELETE", "/health", 405, "DELETE")]
    for method, path, status, says in cases:
        response = httpx.request(method, scored.url + path, json={"model": scored.folder, "messages": []},
                                 timeout=30)
        assert response.status_code == status and says in response.json()["error"]["message"], (path, response.text)
    assert not any("Traceback" in line for line in scored.errors)


def test_metrics_are_prometheus_text_counting_what_was_served(scored):
    from prometheus_client.parser import text_string_to_metric_families

    def read() -> dict:
        text = httpx.get(f"{scored.url}/metrics", timeout=30).text
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    before = read()
    answer = scored.complete(prompt="def", max_tokens=5, min_length=10)
    httpx.get(f"{scored.url}/nowhere", timeout=30)
    after = read()

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("lowmem_aitextgen_requests_total", route="/v1/completions", status="200") == 1
    assert grew("lowmem_aitextgen_requests_total", route="other", status="404") == 1
    assert grew("lowmem_aitextgen_completion_tokens_total") == answer["usage"]["completion_tokens"] == 5
    assert grew("lowmem_aitextgen_prompt_tokens_total") == answer["usage"]["prompt_tokens"]
    assert grew("lowmem_aitextgen_time_to_first_token_seconds_count") == 1
    assert grew("lowmem_aitextgen_request_seconds_count") >= 2
    assert after[("lowmem_aitextgen_queue_depth", ())] == 0 and ("lowmem_aitextgen_decoding_rows", ()) in after


def test_each_request_logs_one_access_line(scored):
    before = len(scored.errors)
    scored.complete(prompt="def", max_tokens=4, min_length=10)
    deadline = time.monotonic() + 10
    while len(scored.errors) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    new = [line for line in scored.errors[before:] if "/v1/completions" in line]
    assert len(new) == 1 and "POST /v1/completions 200 4 tokens" in new[0] and new[0].rstrip().endswith("ms")


def test_cors_answers_the_origin_it_was_given_and_no_other(scored):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(f"{scored.url}/v1/completions", headers={"Origin": ORIGIN, **ask}, timeout=30)
    other = httpx.options(f"{scored.url}/v1/completions", headers={"Origin": "https://else.example", **ask},
                          timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in other.headers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serves(port: int, within: float = 30) -> bool:
    """Whether /health on `port` answers 200 within `within` seconds (refused connections and other answers, as a
    proxy's 502 before its upstream is up, tried again)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


def test_two_servers_racing_for_one_port_the_loser_exits_non_zero_naming_it(tmp_path, tokenizer_file):
    port = free_port()
    folder = model_folder(tmp_path / "model", n_positions=64)
    command = [sys.executable, "-m", "lowmem_aitextgen.cli", "serve", folder, f"--tokenizer_file={tokenizer_file}",
               f"--port={port}"]
    racers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(racer.poll() is None for racer in racers) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = [racer for racer in racers if racer.poll() is not None]
        assert len(ended) == 1, "exactly one of two servers on one port ends"
        assert serves(port), "the other server holds the port and answers"
        loser = ended[0]
        error = loser.stderr.read()
        assert loser.returncode == 2 and f"--port={port}" in error and "cannot listen there" in error
        assert "Traceback" not in error
    finally:
        for racer in racers:
            stop_server(racer)


TASKS = """
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {choice}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""
ROLLING = """
task: tiny_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {text}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""


def lm_eval_tasks(folder) -> str:
    """Two tasks over local files: a log-likelihood one (multiple choice) and a perplexity one (rolling)."""
    from conftest import corpus_text

    words = corpus_text(4000).split()
    with open(folder / "choice.jsonl", "w", encoding="utf-8") as file:
        for i in range(4):
            choices = [" ".join(words[i * 20 + j * 3:i * 20 + j * 3 + 3]) for j in range(3)]
            file.write(json.dumps({"question": " ".join(words[i * 20 + 10:i * 20 + 18]), "choices": choices,
                                   "answer": i % 3}) + "\n")
    with open(folder / "text.jsonl", "w", encoding="utf-8") as file:
        for i in range(2):
            file.write(json.dumps({"text": " ".join(words[300 + i * 150:300 + i * 150 + 120])}) + "\n")
    (folder / "tiny_choice.yaml").write_text(TASKS.format(choice=folder / "choice.jsonl"), encoding="utf-8")
    (folder / "tiny_perplexity.yaml").write_text(ROLLING.format(text=folder / "text.jsonl"), encoding="utf-8")
    return str(folder)


def lm_eval_scores(model: str, model_args: dict, tasks: str) -> dict[str, list[tuple[float, str]]]:
    """lm-eval's own run: each task's per-request log-likelihoods, in its order, each with the text it scored."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["tiny_choice", "tiny_perplexity"],
                              task_manager=TaskManager(include_path=tasks), log_samples=True, batch_size=1)
    scores = {}
    for task, samples in results["samples"].items():
        scores[task] = [(float(resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0]), arguments[-1])
                        for sample in sorted(samples, key=lambda s: s["doc_id"])
                        for resp, arguments in zip(sample["resps"], sample["arguments"])]
    return scores


def test_the_start_of_text_token_goes_first_only_where_asked_for_text_and_token_ids_alike(scored_line_by_line,
                                                                                          truth, tokenizer_file):
    """completions.first_token, on a model trained line by line: a prompt's echoed tokens are the client's text's
    (or ids), after the start-of-text token only with prepend_bos (then the text generate() makes by default)."""
    ai, _ = truth
    server, prompt = scored_line_by_line, "def main(): return"
    ids = ai.tokenizer(prompt)["input_ids"]
    for sent in (prompt, ids):
        for prepend in (False, True):
            made = server.client(key="none").completions.create(
                model=server.folder, prompt=sent, max_tokens=0, echo=True, logprobs=0, temperature=0,
                extra_body={"prepend_bos": prepend})
            assert len(made.choices[0].logprobs.tokens) == len(ids) + prepend, (sent, prepend)
    served = server.client(key="none").completions.create(model=server.folder, prompt=prompt, max_tokens=8,
                                                           temperature=0, extra_body={"prepend_bos": True})
    line_model = aitextgen(model_folder=server.folder, tokenizer_file=tokenizer_file)
    assert prompt + served.choices[0].text == line_model.generate_one(prompt=prompt, max_new_tokens=8,
                                                                      do_sample=False, lstrip=False)


@pytest.mark.parametrize("trained", ["on one text", "line by line"])
@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_scores_the_served_model_as_the_saved_model_scores(scored, scored_line_by_line, truth, tmp_path,
                                                                   monkeypatch, tokenized, trained):
    """lm-evaluation-harness' local-completions model against the server: its log-likelihoods (a multiple-choice
    task and a perplexity task) within the serving form's bound of what its own hf model computes from the
    saved folder (transformers' teacher-forced), token ids sent or text, for a model trained on one text and one
    trained line by line (the server put a start-of-text token before the latter's text prompts, and lm-eval's
    slice of the echoed logprobs was a token off: 7 nats)."""
    ai, bound = truth
    scored = scored if trained == "on one text" else scored_line_by_line
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    ai.tokenizer.save_pretrained(tmp_path / "tokenizer")
    tasks = lm_eval_tasks(tmp_path)
    served = lm_eval_scores("local-completions", {
        "model": scored.folder, "base_url": f"{scored.url}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": str(tmp_path / "tokenizer"), "tokenized_requests": tokenized, "max_length": 128,
        "num_concurrent": 1, "max_retries": 1}, tasks)
    saved = lm_eval_scores("hf", {"pretrained": scored.folder, "tokenizer": str(tmp_path / "tokenizer"),
                                  "dtype": "float32", "device": "cpu", "max_length": 128}, tasks)
    assert served.keys() == saved.keys() and all(len(served[t]) == len(saved[t]) > 1 for t in saved)
    for task in saved:
        for (ours, text), (theirs, same) in zip(served[task], saved[task]):
            scored_tokens = len(ai.tokenizer(text)["input_ids"]) + 1  # +1: a word boundary may split otherwise
            assert text == same and math.isfinite(ours) and abs(ours - theirs) <= bound * scored_tokens, (
                task, ours, theirs)
        assert all(ours < -1 for ours, _ in served[task])  # scores, not zeros


# --- replicas behind nginx --------------------------------------------------------------------


def nginx_config(tmp_path, listen: int, replicas: list[int]) -> str:
    """docs/serve.md's nginx block, its ports replaced, in a configuration of its own under tmp_path."""
    import os
    import re
    from pathlib import Path

    docs = (Path(__file__).parent.parent / "docs" / "serve.md").read_text(encoding="utf-8")
    block = re.search(r"```nginx\n(.*?)```", docs, re.S).group(1)
    servers = re.findall(r"    server 127\.0\.0\.1:\d+ (.*);", block)
    assert len(servers) == 2
    block = re.sub(r"    server 127\.0\.0\.1:\d+ .*;\n", "", block)
    upstream = "".join(f"    server 127.0.0.1:{port} {servers[0]};\n" for port in replicas)
    block = block.replace("    least_conn;", "    least_conn;\n" + upstream.rstrip("\n"), 1)
    block = re.sub(r"listen \d+;", f"listen 127.0.0.1:{listen};", block)
    temp = "".join(f"    {kind}_temp_path {tmp_path}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi",
                                                                              "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = (f"{user}worker_processes 1;\npid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\n"
            f"events {{ worker_connections 64; }}\nhttp {{\n    access_log {tmp_path}/access.log;\n{temp}"
            f"{block}}}\n")
    (tmp_path / "nginx.conf").write_text(conf, encoding="utf-8")
    return str(tmp_path / "nginx.conf")


def test_two_replicas_behind_nginx_share_requests_and_a_sigterm_loses_none(tmp_path, tokenizer_file):
    """docs/serve.md's nginx upstream in front of two servers: plain and streamed requests answered through it,
    spread over both; one replica stopped with SIGTERM while requests are in flight: every request answered in
    full, the stopped one's included, and new ones go to the other."""
    import shutil
    import signal
    import threading

    import openai

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    folder = model_folder(tmp_path / "model", n_positions=512, n_layer=8, n_embd=512, n_head=8)
    # docs/serve.md: replicas sharing a machine divide its cores (two each taking both: at times past --timeout)
    # each text in flight ends whole within --shutdown_timeout (docs/serve.md: the longest request)
    replicas = [start_server(folder, tokenizer_file, "--max_tokens=400", "--max_batch=4", "--threads=1",
                             "--shutdown_timeout=60") for _ in range(2)]
    port = free_port()
    conf = nginx_config(tmp_path, port, [int(r.url.rsplit(":", 1)[1]) for r in replicas])
    proxy = subprocess.Popen([nginx, "-c", conf, "-p", str(tmp_path), "-g", "daemon off;"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        assert serves(port, 20), "nginx answers"
        plain = client.completions.create(model=folder, prompt="def", max_tokens=8, seed=3)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=folder, prompt="def", max_tokens=8, seed=3, stream=True))
        assert streamed == plain.choices[0].text

        answers: list = []
        failures: list = []

        def ask(k: int) -> None:
            started = time.monotonic()
            try:
                made = client.completions.create(model=folder, prompt=f"x{k}", max_tokens=300, seed=k,
                                                 extra_body={"min_length": 400})
                answers.append(made.choices[0])
            except Exception as failure:  # noqa: BLE001 - said in the assertion below, not lost in a thread
                failures.append(f"{k} after {time.monotonic() - started:.1f} s: {failure!r}")

        askers = [threading.Thread(target=ask, args=(k,)) for k in range(6)]
        for asker in askers:
            asker.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(r.health()["decoding_rows"] for r in replicas):
            time.sleep(0.05)
        assert all(r.health()["decoding_rows"] for r in replicas), "least_conn spread the requests over both"
        replicas[0].process.send_signal(signal.SIGTERM)
        after = [client.completions.create(model=folder, prompt="def", max_tokens=4) for _ in range(3)]
        for asker in askers:
            asker.join(timeout=120)
        assert not failures, failures
        assert len(answers) == 6 and all(a.finish_reason == "length" for a in answers)  # none lost or cut
        assert all(len(a.choices[0].text) > 0 for a in after)
        assert replicas[0].process.wait(timeout=60) == 0
    finally:
        proxy.send_signal(signal.SIGQUIT)
        try:
            proxy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proxy.kill()
        for replica in replicas:
            stop_server(replica.process)


def test_a_failure_no_route_answers_is_a_json_500_logged_and_the_app_goes_on(scored, tokenizer_file, caplog):
    """Something of ours failing inside a request (here the prompt's encoding, made to raise what no check
    expects): OpenAI's JSON error with status 500, the traceback in the log, the next request answered."""
    from starlette.testclient import TestClient

    from lowmem_aitextgen.serving.serving import Server, ServeSettings, make_app

    server = Server(aitextgen(model_folder=scored.folder, tokenizer_file=tokenizer_file), "m", ServeSettings())
    server.encode = lambda prompt, bos: (_ for _ in ()).throw(RuntimeError("a bug of ours"))
    with TestClient(make_app(server), raise_server_exceptions=False) as client:
        failed = client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        health = client.get("/health")
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in failed.json()["error"]["message"] and health.status_code == 200
    assert any(record.exc_info and "a bug of ours" in str(record.exc_info[1]) for record in caplog.records)
