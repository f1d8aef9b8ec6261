"""Decoding speed of plain transformers `generate` per lever: weight dtype and KV cache (dynamic, eager;
static, which transformers compiles with CUDA graphs on a GPU), at a batch size, one GPT-2 size.

The levers the generation plan chooses between, measured before that plan exists (issue 47's GPU rows:
eager fp16/bf16 against a static cache with torch.compile). Random weights: speed only. Every text is
forced to `--new` tokens (min_new_tokens), so no early end-of-text shortens a row.

    python benchmarks/generate_levers.py --size 355M --dtype fp16 --cache static --batch 1 --out out.jsonl

Prints one JSON line: tokens/s (median of --repeats timed calls after one warm-up, which holds compilation),
time to first token (the streamer's first new token, in the timed calls), the warm-up's seconds and the
device's peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.streamers import BaseStreamer

SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "774M": (36, 1280, 20), "1558M": (48, 1600, 25)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class FirstTokenClock(BaseStreamer):
    """Records when generate hands over its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def build(size: str, dtype: torch.dtype, device: str) -> GPT2LMHeadModel:
    n_layer, n_embd, n_head = SIZES[size]
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    with torch.device(device):
        model = GPT2LMHeadModel(config).to(dtype)
    return model.eval()


def timed_generate(model: GPT2LMHeadModel, prompt: torch.Tensor, new: int, cache: str) -> tuple[float, float]:
    """Seconds of one whole generate call and seconds to its first new token."""
    clock = FirstTokenClock()
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                       do_sample=True, top_k=0, pad_token_id=model.config.eos_token_id, streamer=clock,
                       cache_implementation="static" if cache == "static" else None)
    sync()
    end = time.perf_counter()
    return end - start, (clock.first_token_at or end) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="355M", choices=SIZES)
    parser.add_argument("--dtype", default="fp16", choices=DTYPES)
    parser.add_argument("--cache", default="dynamic", choices=("dynamic", "static"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens a text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", help="a JSONL file the row is appended to")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build(args.size, DTYPES[args.dtype], args.device)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=args.device)
    warm_up_seconds, _ = timed_generate(model, prompt, args.new, args.cache)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = [timed_generate(model, prompt, args.new, args.cache) for _ in range(args.repeats)]
    seconds = statistics.median(run[0] for run in runs)
    row = {
        "size": args.size, "dtype": args.dtype, "cache": args.cache, "batch": args.batch,
        "prompt_tokens": args.prompt, "new_tokens": args.new, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens_per_s": round(args.batch * args.new / seconds, 1),
        "first_token_s": round(statistics.median(run[1] for run in runs), 4),
        "warm_up_s": round(warm_up_seconds, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if args.device == "cuda" else None,
    }
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as file:
            file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
