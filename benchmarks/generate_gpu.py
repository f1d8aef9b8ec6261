"""Our generate() end to end on a GPU against transformers' eager generate(), one process, alternating.

Issue 54 item 5: what a user's script gets after `ai.to_gpu()` (aitextgen's fp32 model on the card; our plan
decodes it in 16 bits) and after `ai.to_gpu(); ai.to_fp16()`, beside transformers' eager generate() on fp16 and
fp32 copies of the same weights. Random weights (speed only), a 16-token prompt, --new tokens a text (forced),
sampling, unseeded and seeded. Each path's first call (the view made) is reported apart as its warm-up.

    python benchmarks/generate_gpu.py --size 355M --batch 1 --out out.jsonl

Prints one JSON line a path: tokens/s (median of --repeats), time to first token (a call of one new token),
warm-up seconds, the card's peak memory over the whole process so far.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from transformers import GPT2Config

from lowmem_aitextgen import aitextgen

SIZES = {"124M": (12, 768, 12), "355M": (24, 1024, 16), "1558M": (48, 1600, 25)}
PROMPT = "The quick brown fox jumps over the lazy dog and then runs off into the"  # 16 GPT-2 tokens


def transformers_path(model: torch.nn.Module) -> Callable[[torch.Tensor, int], None]:
    def run(prompt: torch.Tensor, new: int) -> None:
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, top_k=0, pad_token_id=model.config.eos_token_id)
    return run


def ours_path(ai: aitextgen, seed: int | None) -> Callable[[torch.Tensor, int], None]:
    def run(prompt: torch.Tensor, new: int) -> None:
        text = ai.tokenizer.decode(prompt[0].tolist())
        ai.generate(n=prompt.shape[0], prompt=text, max_new_tokens=new, min_new_tokens=new, top_k=0,
                    return_as_list=True, nonempty_output=False, seed=seed)
    return run


def timed(run: Callable[[torch.Tensor, int], None], prompt: torch.Tensor, new: int) -> float:
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    run(prompt, new)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="355M", choices=SIZES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    n_layer, n_embd, n_head = SIZES[args.size]
    torch.manual_seed(0)
    ai = aitextgen(config=GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head))
    fp16 = aitextgen(config=GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head))
    fp16.model.load_state_dict(ai.model.state_dict())
    if torch.cuda.is_available():  # else a smoke run of the script on a CPU
        ai.to_gpu()
        fp16.to_gpu()
    fp16.to_fp16()  # on the card: halved there (on a CPU it stays fp32)
    paths = {"ours, to_gpu()": ours_path(ai, None), "ours, to_gpu(), seeded": ours_path(ai, 1),
             "ours, to_gpu() + to_fp16()": ours_path(fp16, None),
             "transformers eager fp16": transformers_path(fp16.model),
             "transformers eager fp32 (aitextgen's)": transformers_path(ai.model)}
    prompt = ai.tokenizer(PROMPT, return_tensors="pt")["input_ids"].repeat(args.batch, 1)
    prompt = prompt.to(ai.model.device)
    warm = {name: timed(run, prompt, args.new) for name, run in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, run in paths.items():
            times[name].append(timed(run, prompt, args.new))
    for name, run in paths.items():
        row = {"size": args.size, "batch": args.batch, "path": name, "new_tokens": args.new,
               "device_name": torch.cuda.get_device_name() if prompt.is_cuda else "cpu", "torch": torch.__version__,
               "tokens_per_s": round(args.batch * args.new / statistics.median(times[name]), 1),
               "first_token_s": round(timed(run, prompt, 1), 4), "warm_up_s": round(warm[name], 2),
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if prompt.is_cuda else None}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as file:
                file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
