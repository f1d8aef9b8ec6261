"""`lowmem_aitextgen serve` under load, on this machine: GPT-2 355M (random weights: speed only), the server
started for real (the CLI, a free port), clients on the same machine.

    python benchmarks/serve_load.py                  # 355M; --size 124M for a quicker look
    python benchmarks/serve_load.py --mixed          # only the mixed workload
    python benchmarks/serve_load.py --size 124M --clients 16 --requests 1000   # issue 53's rows
    python benchmarks/serve_load.py --clients 16 --rounds 8 --against /tmp/before   # this checkout's server
                                                                                     # against another's

Reports, in one run: aggregate tokens/s of one client at a time against --clients concurrent clients (64 new
tokens each, exactly: min_length), alternated --rounds times, the median of each round's ratio and the
concurrent requests' p50/p95 latency; resident memory after 10 and after --requests requests in a row; the
slowest answer to a request carrying a bad field, and its statuses; the mixed workload: 8 requests of 32
tokens arriving together 0.5 s after a 900-token stream started, their median latency against the same
requests' on the idle server, and the stream's tokens (none lost).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from transformers import GPT2Config

from lowmem_aitextgen import aitextgen, hardware

SIZES = {"124M": dict(n_layer=12, n_embd=768, n_head=12), "355M": dict(n_layer=24, n_embd=1024, n_head=16)}
PROMPT, NEW = "The meaning of life is", 64
CLIENTS = 8  # --clients
MIXED = 8  # the mixed workload's short requests


def start(folder: str, checkout: str | None = None) -> tuple[subprocess.Popen, str, str]:
    """The server of this checkout, or of `checkout` (a worktree put first on its PYTHONPATH), its URL and the
    file its stderr goes to."""
    environment = dict(os.environ)
    if checkout is not None:
        environment["PYTHONPATH"] = os.pathsep.join([checkout, *filter(None, [os.environ.get("PYTHONPATH")])])
    log = os.path.join(folder, "server.log" if checkout is None else "server-against.log")
    # run in the checkout: `python -m` puts the working folder ahead of PYTHONPATH, so from this repository's root
    # the other checkout's server imported this one's package
    process = subprocess.Popen([sys.executable, "-m", "lowmem_aitextgen.cli", "serve", folder, "--port=0",
                                f"--max_batch={max(CLIENTS, MIXED) + 1}", "--max_tokens=1000", "--timeout=600"],
                               stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=environment,
                               cwd=checkout)
    for line in iter(process.stdout.readline, ""):
        found = re.search(r"http://[\d.]+:\d+", line)
        if found:
            return process, found.group(0), log
    raise RuntimeError("the server did not start")


def ask(url: str, folder: str, new: int, seed: int, client: httpx.Client | None = None) -> float:
    """One request of exactly `new` tokens (through `client`, a client of the caller's, kept as the OpenAI client
    keeps one: a new httpx client costs ~30 ms of the caller's CPU); its seconds."""
    body = {"model": folder, "prompt": PROMPT, "max_tokens": new, "min_length": 1024, "seed": seed}  # no early end
    start_time = time.perf_counter()
    response = (client or httpx).post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == new
    return time.perf_counter() - start_time


def one_at_a_time(url: str, folder: str, requests: int) -> float:
    with httpx.Client() as client:
        start_time = time.perf_counter()
        for seed in range(requests):
            ask(url, folder, NEW, seed, client)
        return requests * NEW / (time.perf_counter() - start_time)


def concurrent(url: str, folder: str, rounds: int) -> tuple[float, list[float]]:
    """CLIENTS clients at once, each with a client of its own made before the clock starts, `rounds` requests
    each: aggregate tokens/s and each request's latency."""
    latencies: list[float] = []
    clients = [httpx.Client() for _ in range(CLIENTS)]

    def client(index: int) -> None:
        for round_ in range(rounds):
            latencies.append(ask(url, folder, NEW, 1000 * index + round_, clients[index]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    start_time = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rate = CLIENTS * rounds * NEW / (time.perf_counter() - start_time)
    for each in clients:
        each.close()
    return rate, latencies


def mixed(url: str, folder: str) -> dict[str, object]:
    """8 requests of 32 tokens, together, one at a time on the idle server and then 0.5 s after a 900-token
    stream started: their median latency, the ratio, and the stream's token count."""
    idle = statistics.median(ask(url, folder, 32, seed) for seed in range(MIXED))
    events: list[str] = []

    def stream_long() -> None:
        body = {"model": folder, "prompt": PROMPT, "max_tokens": 900, "min_length": 1024, "seed": 99, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            events.extend(line for line in response.iter_lines() if line.startswith("data: "))

    long = threading.Thread(target=stream_long)
    long.start()
    time.sleep(0.5)
    latencies: list[float] = []
    threads = [threading.Thread(target=lambda seed=seed: latencies.append(ask(url, folder, 32, seed)))
               for seed in range(MIXED)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    long.join()
    usage = next(json.loads(e[6:])["usage"] for e in reversed(events) if e != "data: [DONE]" and '"usage"' in e)
    busy = statistics.median(latencies)
    return {"idle median s": round(idle, 2), "beside the stream median s": round(busy, 2),
            "ratio": round(busy / idle, 2), "stream tokens": usage["completion_tokens"]}


def resident(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def memory_over(url: str, folder: str, pid: int, requests: int) -> dict[str, float]:
    after = {}
    for i in range(requests):
        ask(url, folder, 16, i)
        if i + 1 in (10, requests):
            after[i + 1] = resident(pid)
    return {"RSS after 10 MiB": round(after[10] / 2**20), f"RSS after {requests} MiB": round(after[requests] / 2**20),
            "ratio": round(after[requests] / after[10], 3)}


BAD = [b"{\"model\": ", {"max_tokens": "ten"}, {"max_tokens": 10**6}, {"logprobs": 9}, {"temperature": -1},
       {"prompt": [10**7]}, {"stop": 5}, {"n": 0}, {"unknown": 1}, {"prompt": "word " * 1100}]


def bad_fields(url: str, folder: str) -> dict[str, object]:
    times, statuses = [], set()
    for body in BAD:
        content = body if isinstance(body, bytes) else json.dumps({"model": folder, "prompt": "a", **body}).encode()
        start_time = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", content=content, timeout=60,
                              headers={"Content-Type": "application/json"})
        times.append(time.perf_counter() - start_time)
        statuses.add(response.status_code)
    return {"slowest ms": round(1000 * max(times), 1), "statuses": sorted(statuses)}


def throughput_and_memory(url: str, folder: str, pid: int, requests: int, rounds: int) -> dict[str, object]:
    """One client at a time against CLIENTS at once, alternating `rounds` times: this machine's speed drifts by
    up to a fifth between minutes, so each round's ratio is of two phases side by side, and the median is
    reported."""
    solo, together, latencies = [], [], []
    for _ in range(rounds):
        solo.append(one_at_a_time(url, folder, max(4, CLIENTS // 2)))
        rate, times = concurrent(url, folder, 1)
        together.append(rate)
        latencies += times
    ratios = [t / s for s, t in zip(solo, together)]
    return {"one at a time tokens/s": round(statistics.median(solo), 1),
            f"{CLIENTS} concurrent tokens/s": round(statistics.median(together), 1),
            "ratio": round(statistics.median(ratios), 2), "ratio of each round": [round(r, 2) for r in ratios],
            "latency s p50/p95": [round(statistics.median(latencies), 2),
                                  round(statistics.quantiles(latencies, n=20)[-1], 2)],
            "bad fields": bad_fields(url, folder), "memory": memory_over(url, folder, pid, requests)}


def against(urls: dict[str, str], folder: str, rounds: int) -> dict[str, object]:
    """--against: each server's one client at a time and CLIENTS at once, the servers alternating round by round
    (the first of a round alternating too); medians, and this / against of each round."""
    solo: dict[str, list[float]] = {name: [] for name in urls}
    together: dict[str, list[float]] = {name: [] for name in urls}
    for round_ in range(rounds):
        for name in list(urls)[::1 if round_ % 2 == 0 else -1]:
            solo[name].append(one_at_a_time(urls[name], folder, max(4, CLIENTS // 2)))
            together[name].append(concurrent(urls[name], folder, 1)[0])
    this, other = together.values()
    return {name: {"one at a time tokens/s": round(statistics.median(solo[name]), 1),
                   f"{CLIENTS} concurrent tokens/s": round(statistics.median(together[name]), 1),
                   "ratio": round(statistics.median(t / s for s, t in zip(solo[name], together[name])), 2)}
            for name in urls} | {
        f"{CLIENTS} concurrent, this / against": round(statistics.median(this) / statistics.median(other), 3),
        "of each round": [round(a / b, 3) for a, b in zip(this, other)],
        "one at a time, this / against": round(statistics.median(solo["this checkout"])
                                               / statistics.median(solo["against"]), 3)}


def stop(process: subprocess.Popen, log: str) -> None:
    """SIGTERM, as a service manager stops it (Ctrl-C's SIGINT is ignored in a job started in the background)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise RuntimeError(f"the server did not stop on SIGTERM within 60 s; its log ends:\n{open(log).read()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="355M", choices=SIZES)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--mixed", action="store_true", help="only the mixed workload")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="one client, then all: alternated this many times")
    parser.add_argument("--against", metavar="WORKTREE", help="another checkout's server, alternating (docstring)")
    args = parser.parse_args()
    global CLIENTS
    CLIENTS = args.clients
    report: dict[str, object] = {"cpu": str(hardware.cpu()), "size": args.size, "clients": CLIENTS}
    with tempfile.TemporaryDirectory() as folder:
        aitextgen(config=GPT2Config(**SIZES[args.size])).save(folder)
        servers = {"this checkout": start(folder)}
        try:
            if args.against:
                servers["against"] = start(folder, args.against)  # (the worktree's server)
            urls = {name: url for name, (_, url, _) in servers.items()}
            for url in urls.values():
                ask(url, folder, 8, 0)  # warm-up
            if args.against:
                report |= {"the other checkout": args.against, **against(urls, folder, args.rounds)}
            else:
                (process, url, _), = servers.values()
                report["mixed workload"] = mixed(url, folder)
                if not args.mixed:
                    report.update(throughput_and_memory(url, folder, process.pid, args.requests, args.rounds))
            print(json.dumps(report, indent=1), flush=True)
        finally:
            for process, _, log in servers.values():
                stop(process, log)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
