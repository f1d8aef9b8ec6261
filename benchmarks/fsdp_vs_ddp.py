"""strategy="fsdp" against strategy="ddp" on two CPU processes (gloo): the wall time of the same train()
call, rounds alternating, each run its own pair of processes.

    python benchmarks/fsdp_vs_ddp.py --size 124M --block 256 --steps 8 --rounds 3 --out results.jsonl
    python benchmarks/fsdp_vs_ddp.py --accumulation 4 ...   # 4 micro-batches a step, pinned

Each run fine-tunes GPT-2 `size` (random weights saved once, loaded by both processes) on Python's own
documentation, batch_size=1 x `accumulation` per process (aitextgen's default: 1 x 1), checkpointing on,
fp32, and saves the model: the whole train() call is timed by rank 0 (the issue's target: FSDP within 1.3x
of DDP's wall time).  How much FSDP gathers, and how often, is the planner's choice (plan.gathered_for,
sharding.py): with memory to spare it holds the weights whole from forward to backward, and with
accumulation the gradients whole until the step's last micro-batch; the result names the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
from lowmem_aitextgen import aitextgen
data, base, out, strategy, block, steps, accumulation = sys.argv[1:8]
ai = aitextgen(model_folder=base, tokenizer_file=base + "/tokenizer.json")
start = time.perf_counter()
ai.train(data, output_dir=out, n_gpu=0, devices=2, strategy=strategy, num_steps=int(steps), batch_size=1,
         gradient_accumulation_steps=int(accumulation), block_size=int(block), save_every=0, generate_every=0, seed=1,
         gradient_checkpointing=True, precision="32-true", progress_bar_refresh_rate=1000, pin_micro_batch=True)
import os
if int(os.environ.get("LOCAL_RANK", 0)) == 0:
    print("WALL " + json.dumps(time.perf_counter() - start), flush=True)
"""


def cpu_name() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else platform.processor()} x{len(names)}"


def prepare(folder: str, size: str) -> tuple[str, str]:
    """The text, and a model folder (random GPT-2 `size` weights and a byte-level tokenizer) both runs load."""
    import pydoc_data.topics

    from transformers import GPT2Config, GPT2LMHeadModel

    from lowmem_aitextgen.tokenizers import train_tokenizer
    from lowmem_aitextgen.training.estimate import GPT2_SIZES

    data = os.path.join(folder, "data.txt")
    with open(data, "w", encoding="utf-8") as f:
        f.write("\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:400_000])
    base = os.path.join(folder, "base")
    train_tokenizer(data, vocab_size=50257, prefix=os.path.join(folder, "tok"))
    GPT2LMHeadModel(GPT2Config(**GPT2_SIZES[size])).save_pretrained(base)
    from tokenizers import Tokenizer
    Tokenizer.from_file(os.path.join(folder, "tok.tokenizer.json")).save(os.path.join(base, "tokenizer.json"))
    return data, base


def run(script: str, data: str, base: str, out: str, strategy: str, block: int, steps: int,
        accumulation: int) -> tuple[float, str | None]:
    """The train() call's wall time, and what the plan held gathered (FSDP: sharding.py)."""
    result = subprocess.run([sys.executable, script, data, base, out, strategy, str(block), str(steps), str(accumulation)],
                            capture_output=True, text=True, timeout=1800)
    walls = [line for line in result.stdout.splitlines() if line.startswith("WALL ")]
    if result.returncode != 0 or not walls:
        raise RuntimeError(result.stderr[-3000:])
    with open(os.path.join(out, "training_summary.json"), encoding="utf-8") as f:
        gathered = json.load(f)["plan"].get("gathered_for")
    return json.loads(walls[-1][5:]), gathered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="124M")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--out", help="append the result as a JSON line here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data, base = prepare(folder, args.size)
        script = os.path.join(folder, "child.py")  # Lightning starts rank 1 by running this file again
        with open(script, "w", encoding="utf-8") as f:
            f.write(CHILD)
        walls: dict[str, list[float]] = {"ddp": [], "fsdp": []}
        gathered = set()
        for index in range(args.rounds):
            for strategy in ("ddp", "fsdp") if index % 2 == 0 else ("fsdp", "ddp"):
                wall, held = run(script, data, base, os.path.join(folder, f"out_{strategy}_{index}"), strategy,
                                 args.block, args.steps, args.accumulation)
                walls[strategy].append(wall)
                if strategy == "fsdp":
                    gathered.add(held)
                print(f"round {index}: {strategy} {wall:.1f} s" + (f" (gathered for a {held})" if held else ""),
                      flush=True)
    medians = {strategy: statistics.median(values) for strategy, values in walls.items()}
    result = {"benchmark": "fsdp_vs_ddp", "cpu": cpu_name(), "size": args.size, "block": args.block,
              "steps": args.steps, "accumulation": args.accumulation, "walls_s": walls, "median_s": medians,
              "fsdp_over_ddp": medians["fsdp"] / medians["ddp"], "fsdp_gathered_for": sorted(gathered),
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
