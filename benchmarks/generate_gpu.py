"""Our generate() end to end on a GPU against transformers' eager generate(), one process, alternating.

Issue 54 item 5: what a user's script gets after `ai.to_gpu()` (aitextgen's fp32 model on the card; our plan
decodes it in 16 bits) and after `ai.to_gpu(); ai.to_fp16()`, beside transformers' eager generate() on fp16 and
fp32 copies of the same weights. Random weights (speed only), a 16-token prompt, --new tokens a text (forced),
sampling, unseeded and seeded. Each path's first call (the view made) is reported apart as its warm-up.

    python benchmarks/generate_gpu.py --size 355M --batch 1 --out out.jsonl
    python benchmarks/generate_gpu.py --check   (the stepping decoder on the card against the model's forward;
                                                 a seeded text alone against in a list)

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


def check_stepper(device: str) -> None:
    """The stepping decoder on `device` (engine.Engine over a copy marked a view, as decoding.py's views step):
    each row's scores at each step against the model's own forward over the row's whole text, for a GPT-2 and a
    GPT-Neo (past its local window), in fp32 and fp16, rows of different lengths side by side and one joining
    mid-run.  Prints one JSON line a case: the worst difference (fp32: arithmetic; fp16: within its rounding)."""
    import copy

    from transformers import GPT2LMHeadModel, GPTNeoConfig, GPTNeoForCausalLM

    from lowmem_aitextgen.generation.engine import Decoder, Engine
    from lowmem_aitextgen.generation.sampling import Row, RowSettings

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    models = {"gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=96, n_layer=2, n_embd=64,
                                                         n_head=4)),
              "gpt-neo": lambda: GPTNeoForCausalLM(GPTNeoConfig(
                  vocab_size=50257, max_position_embeddings=96, hidden_size=64, num_layers=2, num_heads=4,
                  attention_types=[[["global", "local"], 1]], window_size=16))}
    tokenizer = aitextgen(config=GPT2Config(n_layer=1, n_embd=64, n_head=4)).tokenizer  # the default one
    for family, make in models.items():
        for dtype in (torch.float32, torch.float16) if device == "cuda" else (torch.float32,):
            torch.manual_seed(0)
            model = make().to(device=device, dtype=dtype).eval()
            engine = Engine(Decoder(copy.deepcopy(model), view=True), tokenizer, (-1,))
            prompts = [torch.randint(1, 50000, (n,)) for n in (5, 1, 30, 3)]
            rows = [Row(p, RowSettings(max_new=24, temperature=0)) for p in prompts]
            engine.join(rows[:2])
            worst = 0.0
            with torch.no_grad():
                for step in range(20):
                    if step == 3:
                        engine.join(rows[2:])
                    for row, scores in zip(engine.rows, engine.scores):
                        whole = torch.cat((row.prompt, torch.tensor(row.tokens, dtype=row.prompt.dtype)))[None]
                        truth = model(input_ids=whole.to(device)).logits[0, -1].float().cpu()
                        worst = max(worst, float((scores - truth).abs().max()))
                    engine.step()
            print(json.dumps({"check": "stepping decoder against the forward", "family": family, "device": device,
                              "dtype": str(dtype), "stepper": engine.stepper is not None,
                              "worst_abs_difference": worst}), flush=True)


def check_seeded(device: str) -> None:
    """A seeded text alone against the same prompt's text in a list of prompts (decoded side by side), by
    generate() at 355M (random weights), after to_gpu() where there is a card: one JSON line, how many of the
    prompts' texts are the same both ways: on this CPU 1 of 5 before each row's attention was computed alone, 5 of
    5 since (RESULTS.md, "The seed rule at 355M")."""
    torch.manual_seed(0)
    ai = aitextgen(config=GPT2Config(n_layer=24, n_embd=1024, n_head=16))
    if device == "cuda":
        ai.to_gpu()
    prompts = ["The meaning of life is", "Once upon a time", "import os", "x", "A long time ago in a galaxy far"]
    options = dict(max_length=64, temperature=1.0, return_as_list=True, nonempty_output=False, seed=7)
    alone = [ai.generate(prompt=p, **options)[0] for p in prompts]
    again = [ai.generate(prompt=p, **options)[0] for p in prompts]
    together = ai.generate(prompt=prompts, **options)
    print(json.dumps({"check": "a seeded text alone against in a list", "device": device,
                      "dtype": str(next(ai.model.parameters()).dtype), "prompts": len(prompts),
                      "repeatable": sum(a == b for a, b in zip(alone, again)),
                      "same in a list": sum(a == b for a, b in zip(alone, together))}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="355M", choices=SIZES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--check", action="store_true", help="only the stepping decoder against the forward")
    args = parser.parse_args()
    if args.check:
        check_stepper("cuda" if torch.cuda.is_available() else "cpu")
        check_seeded("cuda" if torch.cuda.is_available() else "cpu")
        return
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
