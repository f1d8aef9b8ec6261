"""`lowmem_aitextgen serve`, as users run it: the real server (the CLI, on a free port, in its own process),
the real `openai` client, the page in headless Chromium; tiny models on the CPU."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import corpus_text, realistic, tiny_gpt2_config
from lowmem_aitextgen import aitextgen

# tests/test_packaging.py: why .ci/run's oldest-versions pass leaves this file out
NOT_AT_THE_EDGES = ("the server's own behaviour; what it calls of transformers' generate is test_generation's "
                    "and test_decoding's")

KEY = "test-key"
STARTS_WITHIN = 120  # seconds: importing torch and transformers, reading the model


class Served:
    """A server process and how to reach it."""

    def __init__(self, folder: str, process: subprocess.Popen, url: str, errors: list[str]) -> None:
        self.folder, self.process, self.url = folder, process, url
        self.errors = errors  # its stderr's lines so far (the access log among them), read as they come

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def post(self, body, key: str = KEY, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}/v1/completions", content=content, timeout=60,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, **kwargs)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def complete(self, **kwargs) -> dict:
        response = self.post({"model": self.folder, **kwargs})
        assert response.status_code == 200, response.text
        return response.json()


def start_server(folder: str, tokenizer_file: str, *flags: str, step_seconds: float | None = None) -> Served:
    """`lowmem_aitextgen serve FOLDER --port=0 ...` started for real; its address read from its first line;
    step_seconds: each decoding step made that much slower (tests/scripts/serve_slowly.py), a slow machine."""
    command = [sys.executable, "-m", "lowmem_aitextgen.cli"] if step_seconds is None else [
        sys.executable, str(Path(__file__).parent / "scripts" / "serve_slowly.py"), str(step_seconds)]
    process = subprocess.Popen(
        [*command, "serve", folder, f"--tokenizer_file={tokenizer_file}", "--port=0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    lines: list[str] = []
    errors: list[str] = []  # read as they come: a full pipe would stop the server
    for stream, kept in ((process.stdout, lines), (process.stderr, errors)):
        threading.Thread(target=lambda stream=stream, kept=kept: kept.extend(iter(stream.readline, "")),
                         daemon=True).start()
    deadline = time.monotonic() + STARTS_WITHIN
    while time.monotonic() < deadline and process.poll() is None:
        found = next((re.search(r"http://[\d.]+:\d+", line) for line in lines if "Serving" in line), None)
        if found:
            return Served(folder, process, found.group(0), errors)
        time.sleep(0.1)
    stop_server(process)
    raise AssertionError(f"the server did not start: {''.join(errors)[-2000:]}")


def stop_server(process: subprocess.Popen) -> None:
    """SIGINT (Ctrl-C), as a user stops it; killed if it does not end. No process is left behind."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def model_folder(path, **config) -> str:
    torch.manual_seed(0)
    realistic(GPT2LMHeadModel(tiny_gpt2_config(**config))).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_file):
    folder = model_folder(tmp_path_factory.mktemp("served") / "model", n_positions=128)
    server = start_server(folder, tokenizer_file, f"--api_key={KEY}", "--max_tokens=100", "--max_batch=8",
                          "--queue=64")
    yield server
    stop_server(server.process)
    assert server.process.poll() is not None


# a text that takes longer than the busy server's timeout: 1,900 tokens, no early end-of-text (min_length)
LONG = {"prompt": "a", "max_tokens": 1900, "min_length": 2000}


@pytest.fixture(scope="module")
def busy(tmp_path_factory, tokenizer_file):
    """One text at a time, one request waiting, three seconds a request (a text of 1,900 tokens takes longer:
    sixteen blocks 512 wide, a step of milliseconds; eight took under three seconds once a block's step was one
    call, native_block.py): the queue, the timeout and the disconnect."""
    folder = model_folder(tmp_path_factory.mktemp("busy") / "model", n_positions=2048, n_layer=16, n_embd=512,
                          n_head=8)
    server = start_server(folder, tokenizer_file, "--max_tokens=2000", "--max_batch=1", "--queue=1", "--timeout=3")
    yield server
    stop_server(server.process)


# --- the API, through the real client -------------------------------------------------------


def test_a_completion_through_the_openai_client_counts_its_usage(served, tokenizer_file):
    from tokenizers import Tokenizer

    made = served.client().completions.create(model=served.folder, prompt="def main", max_tokens=12, seed=1)
    choice = made.choices[0]
    assert made.object == "text_completion" and made.model == served.folder and isinstance(choice.text, str)
    assert choice.finish_reason in ("stop", "length") and 1 <= made.usage.completion_tokens <= 12
    assert made.usage.prompt_tokens == len(Tokenizer.from_file(tokenizer_file).encode("def main").ids)
    assert made.usage.total_tokens == made.usage.prompt_tokens + made.usage.completion_tokens
    again = served.client().completions.create(model=served.folder, prompt="def main", max_tokens=12, seed=1)
    assert again.choices[0].text == choice.text  # a seed repeats


def test_a_list_of_prompts_with_n_gives_each_choice_as_its_own_request_would(served):
    made = served.client().completions.create(model=served.folder, prompt=["def", "class Foo"], n=2, seed=5,
                                              max_tokens=16, temperature=1.0, top_p=0.9)
    assert [c.index for c in made.choices] == [0, 1, 2, 3]
    for choice in made.choices:  # choice k: choice k % n of prompt k // n (sampling.row_seed)
        alone = served.complete(prompt=["def", "class Foo"][choice.index // 2], seed=5, n=choice.index % 2 + 1,
                                max_tokens=16, temperature=1.0, top_p=0.9)
        assert alone["choices"][choice.index % 2]["text"] == choice.text


def test_stop_ends_the_text_before_the_stop_string(served):
    full = served.complete(prompt="import", max_tokens=60, seed=3, temperature=1.0)["choices"][0]["text"]
    assert len(full) > 12, full
    stop = full[8:11]
    made = served.client().completions.create(model=served.folder, prompt="import", max_tokens=60, seed=3,
                                              temperature=1.0, stop=[stop, "\x00never"])
    assert (made.choices[0].text, made.choices[0].finish_reason) == (full[:full.find(stop)], "stop")


def test_streamed_pieces_join_to_the_text_of_the_same_request_unstreamed(served):
    common = dict(model=served.folder, prompt="for x in", max_tokens=30, seed=11, temperature=1.0)
    whole = served.client().completions.create(**common)
    chunks = list(served.client().completions.create(stream=True, stream_options={"include_usage": True},
                                                     **common))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and len([c for c in chunks if c.choices]) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_streams_finish_follows_its_last_piece_at_once(served):
    """A stream's finish and [DONE] come when its text has ended, not at the next look at the deadline (up to
    serving.POLL_SECONDS later): a client waiting for the end of a text is not kept waiting."""
    gaps = []
    for seed in range(8):
        stream = served.client().completions.create(model=served.folder, prompt="def", max_tokens=6, seed=seed,
                                                    stream=True)
        last_piece = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                last_piece = time.monotonic()
        gaps.append(time.monotonic() - last_piece)
    assert max(gaps) < 0.5, gaps


def test_models_lists_the_served_model_with_its_plan_and_health_answers(served):
    listed = served.client().models.list().data
    assert [m.id for m in listed] == [served.folder] and "Decoding in int8, each token alone" in listed[0].plan
    assert served.health()["status"] == "ok"


def test_thirty_two_concurrent_requests_each_get_their_solo_answer(served):
    solo = {seed: served.complete(prompt="x =", max_tokens=10, seed=seed, temperature=1.0)["choices"][0]["text"]
            for seed in range(32)}
    answers: dict[int, str] = {}

    def ask(seed: int) -> None:
        answers[seed] = served.complete(prompt="x =", max_tokens=10, seed=seed, temperature=1.0)["choices"][0][
            "text"]

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == solo
    assert len(set(solo.values())) > 1  # the seeds drew different texts: each row kept its own stream


# --- refused, and the server goes on ----------------------------------------------------------


@pytest.mark.parametrize("body, status, says", [
    (b"x" * (2 << 20), 400, "larger than"),
    (b"{\"model\": ", 400, "not valid JSON"),
    ({"max_tokens": "ten"}, 400, "max_tokens='ten'"),
    ({"max_tokens": 101}, 400, "max_tokens=101"),
    ({"prompt": "word " * 200, "max_tokens": 50}, 400, "context of 128"),
    ({"best_of": 3}, 400, "best_of is not supported"),
    ({"temperature": 3}, 400, "temperature=3"),
    ({"top_p": 1.5}, 400, r"top_p=1.5 must be in (0, 1]; e.g. top_p=0.9"),  # generate()'s own message
    ({"top_k": 1.5}, 400, "top_k=1.5 must be an integer >= 0"),
    ({"top_k": -1}, 400, "top_k=-1 must be an integer >= 0"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty=0 must be in (0, inf"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"n": 9}, 400, "n=9"),
    ({"seed": -1}, 400, "seed=-1"),
    ({"files": "/etc/passwd"}, 400, "Unknown field 'files'"),
    ({"model": "gpt-4"}, 404, "serves"),
])
def test_bad_requests_are_refused_naming_the_field_and_the_server_goes_on(served, body, status, says):
    if isinstance(body, dict):
        body = {"model": served.folder, "prompt": "a", **body}
    response = served.post(body)
    assert response.status_code == status and says in response.json()["error"]["message"], response.text
    assert served.complete(prompt="a", max_tokens=3)["choices"]


def test_a_wrong_or_missing_key_is_refused_and_nothing_is_decoded(served):
    before = served.health()["decoded_rows"]
    with pytest.raises(openai.AuthenticationError):
        served.client("wrong").completions.create(model=served.folder, prompt="a", max_tokens=3)
    response = httpx.post(f"{served.url}/v1/completions", json={"model": served.folder, "prompt": "a"}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert served.health()["decoded_rows"] == before


def test_a_full_queue_is_answered_429_at_once_with_retry_after(busy):
    long = threading.Thread(target=lambda: busy.post({**LONG, "model": busy.folder}))
    long.start()
    wait_until(lambda: busy.health()["decoding_rows"] == 1)
    waiting = threading.Thread(target=lambda: busy.post({"model": busy.folder, "prompt": "b", "max_tokens": 5}))
    waiting.start()
    wait_until(lambda: busy.health()["queued"] == 1)
    refused = busy.post({"model": busy.folder, "prompt": "c", "max_tokens": 5})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    long.join(timeout=60)
    waiting.join(timeout=60)
    assert_idle(busy)


def test_a_request_past_the_timeout_answers_504_and_frees_its_place(busy):
    before = busy.health()["cancelled_rows"]["timed out"]
    response = busy.post({**LONG, "model": busy.folder})
    assert response.status_code == 504 and "--timeout=3" in response.json()["error"]["message"]
    assert busy.health()["cancelled_rows"]["timed out"] == before + 1
    wait_until(lambda: busy.health()["decoding_rows"] == 0)
    assert busy.complete(prompt="a", max_tokens=3)["choices"]
    assert_idle(busy)


def test_a_stream_past_the_timeout_ends_with_a_timeout_error_though_its_pieces_flow(busy):
    """--timeout holds for a stream as for any request: its pieces coming steadily, it ends at the deadline
    with OpenAI's timeout error as its last event, and its rows stop."""
    before = busy.health()["cancelled_rows"]["timed out"]
    started = time.monotonic()
    body = {**LONG, "model": busy.folder, "stream": True}
    with httpx.stream("POST", f"{busy.url}/v1/completions", json=body, timeout=30) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - started
    assert json.loads(events[-1])["error"]["type"] == "timeout_error" and 3 <= took < 4.5
    assert len(events) > 2  # pieces came before the deadline
    assert busy.health()["cancelled_rows"]["timed out"] == before + 1
    wait_until(lambda: busy.health()["decoding_rows"] == 0)
    assert_idle(busy)


def test_a_client_leaving_mid_stream_stops_its_decoding(busy):
    before = busy.health()["cancelled_rows"]["client left"]
    body = {**LONG, "model": busy.folder, "stream": True}
    with httpx.stream("POST", f"{busy.url}/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # the first piece: decoding
    wait_until(lambda: busy.health()["cancelled_rows"]["client left"] == before + 1)
    wait_until(lambda: busy.health()["decoding_rows"] == 0)
    assert busy.complete(prompt="a", max_tokens=3)["choices"]
    assert_idle(busy)


def test_sigterm_answers_the_queue_at_once_ends_the_streams_at_the_drain_deadline_and_exits(tmp_path,
                                                                                            tokenizer_file):
    """On a slow machine (each step 0.1 s: a long text takes 30 s), SIGTERM with three streams decoding and three
    requests queued: the queued ones answered 503 at once, as is one sent after it; a short stream ends whole
    within --shutdown_timeout, the long ones end there with an error event (503); the process exits 0 within the
    deadline and 5 s."""
    folder = model_folder(tmp_path / "model", n_positions=512)
    server = start_server(folder, tokenizer_file, "--max_batch=3", "--queue=8", "--shutdown_timeout=3",
                          "--max_tokens=300", step_seconds=0.1)
    answers: dict[str, object] = {}

    def stream(name: str, tokens: int) -> None:
        body = {"model": folder, "prompt": "a", "max_tokens": tokens, "min_length": tokens + 2, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            answers[name] = [line for line in response.iter_lines() if line]

    def plain(name: str) -> None:
        try:
            answers[name] = server.post({"model": folder, "prompt": "b", "max_tokens": 5}).status_code
        except httpx.TransportError as error:  # sent after the listening socket closed
            answers[name] = type(error).__name__
        answers[name + " at"] = time.monotonic()

    try:
        askers = [threading.Thread(target=stream, args=(f"long {k}", 300)) for k in range(2)]
        askers += [threading.Thread(target=stream, args=("short", 12))]
        for asker in askers:
            asker.start()
        wait_until(lambda: server.health()["decoding_rows"] == 3)
        queued = [threading.Thread(target=plain, args=(f"queued {k}",)) for k in range(3)]
        for asker in queued:
            asker.start()
        wait_until(lambda: server.health()["queued"] == 3)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        late = threading.Thread(target=plain, args=("late",))
        late.start()
        for asker in [*askers, *queued, late]:
            asker.join(timeout=30)
        assert server.process.wait(timeout=3 + 5) == 0
        exited = time.monotonic() - signalled
    finally:
        stop_server(server.process)
    assert [answers[f"queued {k}"] for k in range(3)] == [503] * 3
    assert all(answers[f"queued {k} at"] - signalled < 1.5 for k in range(3))
    assert answers["late"] in (503, "ConnectError")
    assert answers["short"][-1] == "data: [DONE]"
    for k in range(2):
        last = json.loads(answers[f"long {k}"][-1].removeprefix("data: "))
        assert last["error"]["code"] is None and "stopping" in last["error"]["message"], last
    assert exited < 3 + 5


def assert_idle(server: Served) -> None:
    """Nothing left decoding: the server's process takes (almost) no CPU time over a second."""
    before = cpu_seconds(server.process.pid)
    time.sleep(1)
    assert cpu_seconds(server.process.pid) - before < 0.2


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux: /proc/PID/stat's utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.02)


# --- the page, in a real browser -----------------------------------------------------------------


def test_the_page_streams_a_text_in_headless_chromium(served):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"  # Debian's chromium and chromium-driver (.ci/run installs them)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        browser.get(served.url + "/")
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "prompt").send_keys("def main")
        seed = browser.find_element(By.ID, "seed")
        seed.send_keys("7")
        browser.find_element(By.ID, "generate").click()
        WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "generate").is_enabled()
                                         and b.find_element(By.ID, "text").text)
        shown = browser.find_element(By.ID, "text").get_attribute("textContent")
        assert browser.find_element(By.ID, "model").text == served.folder
        assert "Decoding in int8" in browser.find_element(By.ID, "plan").text
        expected = served.complete(prompt="def main", max_tokens=64, temperature=0.7, top_p=0.9, seed=7)
        assert shown == expected["choices"][0]["text"] and browser.find_element(By.ID, "status").text == ""
    finally:
        browser.quit()


# --- the CLI's checks -------------------------------------------------------------------------


@pytest.mark.parametrize("flag, says", [
    ("--port=70000", "--port=70000"), ("--max_batch=0", "--max_batch=0"), ("--timeout=-1", "--timeout=-1"),
    ("--max_tokenz=5", "unknown flag --max_tokenz"), ("--port=TAKEN", "cannot listen there"),
    ("--threads=0", "--threads=0"), ("--threads=1.5", "--threads=1.5"),
])
def test_serve_refuses_bad_flags_before_reading_the_model(flag, says, tmp_path):
    import socket

    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flag = flag.replace("TAKEN", str(taken.getsockname()[1]))
        result = subprocess.run([sys.executable, "-m", "lowmem_aitextgen.cli", "serve", str(tmp_path / "missing"),
                                 flag], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr


def test_threads_are_the_ones_this_process_decodes_with():
    """--threads (replicas sharing a machine's cores) set torch's threads; left out, torch's own stay."""
    from lowmem_aitextgen.serving.serving import ServeSettings

    before = torch.get_num_threads()
    try:
        ServeSettings().take_threads()
        assert torch.get_num_threads() == before
        ServeSettings(threads=1).take_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_serve_without_its_extra_names_the_install_line(monkeypatch):
    from lowmem_aitextgen import _compat
    from lowmem_aitextgen.serving.serving import INSTALL_SERVE, ServeSettings

    monkeypatch.setattr(_compat, "importable", lambda module: module != "uvicorn")  # as where it is missing
    with pytest.raises(ValueError, match="serve needs uvicorn, which is not installed") as refused:
        ServeSettings().check()
    assert INSTALL_SERVE in str(refused.value) and 'lowmem_aitextgen[serve]' in INSTALL_SERVE


@pytest.mark.parametrize("fields, repeatable", [({"seed": 1}, True), ({"temperature": 0}, True),
                                                ({"temperature": 0.8}, False)])
def test_a_request_whose_text_must_repeat_is_decoded_alone(fields, repeatable):
    """A seeded or greedy request's rows have their attention computed alone (the same text beside any others);
    an unseeded sampled one's the batch's (cheaper: nothing asks it to repeat)."""
    import json

    from lowmem_aitextgen.serving import completions

    request = completions.parse(json.dumps({"model": "m", "prompt": "x", **fields}).encode(),
                                completions.Limits("m", 1024))
    assert request.settings(torch.tensor([1, 2]), 0).repeatable is repeatable


@pytest.mark.parametrize("family", ["gpt2", "gpt-neo", "prefix-tuned gpt2"])
def test_a_seeded_request_is_the_text_generate_makes_in_process(family, tmp_path, tokenizer_file, served):
    """One seed rule (sampling.row_seed) and one form for seeded texts (int8, each token alone): the server
    answers what generate() gives for the same seed and settings, for GPT-2, GPT-Neo and a prefix-tuned model
    (whose generate() tests/test_engine.py holds against the trained model's own forward)."""
    from test_engine import tiny_neo

    if family == "gpt-neo":
        torch.manual_seed(0)
        tiny_neo().save_pretrained(tmp_path / "neo")
        server = start_server(str(tmp_path / "neo"), tokenizer_file, f"--api_key={KEY}")
    elif family == "prefix-tuned gpt2":
        (tmp_path / "text.txt").write_text(corpus_text(10_000), encoding="utf-8")
        base = aitextgen(model_folder=model_folder(tmp_path / "base", n_positions=128), tokenizer_file=tokenizer_file)
        base.train(str(tmp_path / "text.txt"), adapter="prefix", output_dir=str(tmp_path / "prefix"), num_steps=10,
                   batch_size=2, learning_rate=3e-1, block_size=32, save_every=0, generate_every=0, seed=1)
        server = start_server(str(tmp_path / "prefix"), tokenizer_file, f"--api_key={KEY}")
    else:
        server = served
    ai = aitextgen(model_folder=server.folder, tokenizer_file=tokenizer_file)
    texts = ["def", "class Foo"]
    if family == "prefix-tuned gpt2":  # and a prompt past the cache's room after the virtual tokens (64 places)
        texts.append(ai.tokenizer.decode(ai.tokenizer(corpus_text(2000))["input_ids"][:80]))
        assert 64 < len(ai.tokenizer(texts[-1])["input_ids"]) <= 128 - 20 - 20
    try:
        settings = dict(max_tokens=20, temperature=0.8, top_p=0.9, top_k=40, seed=11)
        answer = server.complete(prompt=texts, n=2, **settings)["choices"]
    finally:
        if server is not served:
            stop_server(server.process)
    made = ai.generate(prompt=texts, n=2, max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=40,
                       seed=11, return_as_list=True, nonempty_output=False, lstrip=False)
    prompts = [text for text in texts for _ in range(2)]
    assert [p + c["text"] for p, c in zip(prompts, answer)] == made


def test_short_requests_join_a_long_stream_and_are_answered_while_it_goes_on(tmp_path, tokenizer_file):
    """Continuous batching (batching.py): requests that arrive while a long text streams join it at the next step
    and are answered when their own rows end; the long stream loses no token."""
    folder = model_folder(tmp_path / "model", n_positions=1024, n_layer=8, n_embd=512, n_head=8)
    server = start_server(folder, tokenizer_file, "--max_tokens=1000", "--max_batch=4")
    try:
        pieces: list[str] = []
        ended = threading.Event()

        def stream_long() -> None:
            stream = server.client().completions.create(model=folder, prompt="a", max_tokens=900, seed=1,
                                                        stream=True, extra_body={"min_length": 1000})
            pieces.extend(chunk.choices[0].text for chunk in stream)
            ended.set()

        long = threading.Thread(target=stream_long)
        long.start()
        deadline = time.monotonic() + 30
        while not pieces and time.monotonic() < deadline:
            time.sleep(0.05)
        short = [server.complete(prompt=p, max_tokens=8, seed=2)["choices"][0]["text"] for p in ("def", "class")]
        assert not ended.is_set()  # answered while the long one still streams
        long.join(timeout=120)
        assert ended.is_set()
        alone = server.complete(prompt="a", max_tokens=900, seed=1, min_length=1000)["choices"][0]["text"]
        assert "".join(pieces) == alone  # the long text lost nothing to the requests that joined it
        assert short == [server.complete(prompt=p, max_tokens=8, seed=2)["choices"][0]["text"] for p in ("def", "class")]
    finally:
        stop_server(server.process)
