"""Generation speed against the references, in one process, alternating: transformers' fp32 generate()
(aitextgen 0.6.0's path, and ours before issue 47), our exact decoding (decoding="exact"), and our default
plan (decoding.py), seeded and unseeded, for GPT-2 124M and 355M (random weights: speed only), 128 new tokens,
sampling, batch 1 and 8; for each kind of model fine-tuning leaves (--kinds): a plain model held in fp32, a
LoRA run's output saved in bf16 (read from its folder), a prefix-tuned model (20 virtual tokens on the fp32
base).  transformers' fp32 generate() always runs the fp32 weights.

    python benchmarks/generate_speed.py --rounds 3
    python benchmarks/generate_speed.py --sizes 355M --kinds fp32 "bf16 folder" prefix
    python benchmarks/generate_speed.py --sizes --memory 1558M        # peak RSS generating from a saved folder
    python benchmarks/generate_speed.py --sizes --memory 1558M --saved-dtype bf16
    python benchmarks/generate_speed.py --sizes --first-call 355M     # from aitextgen(model_folder=) to a token
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/generate_speed.py --sizes 355M --avx2-only      # as on an AVX2-only CPU (emulated)

Reports tokens/s (the median of the rounds), time to first token (one new token, after a warm-up) and the
ratios to transformers' fp32.  --memory: in a new process, aitextgen(model_folder=<a saved random model>)
generating 32 tokens with a seed (int8 at once; unseeded, a short first call decodes as held where fp32
fits the memory: forms.Form.pays_after), its peak resident size (the whole run: reading, the decoding form,
generating).  --first-call: seconds from the constructor to the end of a first call of 1 and of 128 new tokens,
unseeded.  --avx2-only: our kernels (native.py) read the CPU's flags without AVX-512 and AMX, as on an AVX2-only
CPU; torch's kernel libraries are held to AVX2 by their own variables (above), set before the process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import GPT2Config

from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.native import native

SIZES = {"124M": dict(n_layer=12, n_embd=768, n_head=12), "355M": dict(n_layer=24, n_embd=1024, n_head=16),
         "1558M": dict(n_layer=48, n_embd=1600, n_head=25)}
NEW, PROMPT = 128, "The meaning of"


def transformers_fp32(ai: aitextgen, fp32: torch.nn.Module, batch: int, new: int, prompt: str = PROMPT) -> None:
    ids = ai.tokenizer(prompt, return_tensors="pt")["input_ids"].repeat(batch, 1)
    with torch.inference_mode():
        fp32.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                      min_new_tokens=new, do_sample=True, temperature=0.7, pad_token_id=0)


def ours(decoding: str, seed: int | None = 1, prompt: str = PROMPT):
    def run(ai: aitextgen, fp32: torch.nn.Module, batch: int, new: int) -> None:
        ai.generate(n=batch, prompt=prompt, max_new_tokens=new, min_new_tokens=new, decoding=decoding,
                    return_as_list=True, nonempty_output=False, seed=seed)
    return run


PATHS = {"transformers fp32": transformers_fp32, "ours, exact": ours("exact"), "ours, default": ours("auto"),
         "ours, default, unseeded": ours("auto", None)}


def saved_gpt2(size: str, folder: str) -> None:
    """A GPT-2 of `size` (random weights, seed 0: speed only) and its tokenizer, saved to `folder` as train() saves
    one, the object that made them let go before the folder is loaded."""
    torch.manual_seed(0)
    made = aitextgen(config=GPT2Config(**SIZES[size]))
    made.save(folder)
    made.tokenizer.save_pretrained(folder)


def model_of(kind: str, size: str, folder: str) -> tuple[aitextgen, torch.nn.Module]:
    """The object generating and the fp32 model transformers' generate() runs, for a kind of model."""
    torch.manual_seed(0)
    ai = aitextgen(config=GPT2Config(**SIZES[size]))
    fp32 = ai.model
    if kind == "bf16 folder":  # what a LoRA run saves on a native-bf16 CPU: the merged model in bf16
        ai.model.to(torch.bfloat16).save_pretrained(folder)
        fp32 = fp32.float()
        ai = aitextgen(model_folder=folder)
    elif kind == "prefix":
        from peft import PrefixTuningConfig, get_peft_model

        ai.model = get_peft_model(ai.model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=20))
    return ai, fp32


def speeds(size: str, rounds: int, kind: str = "fp32") -> dict:
    with tempfile.TemporaryDirectory() as folder:
        ai, fp32 = model_of(kind, size, folder)
        return _timed(ai, fp32, rounds)


def _timed(ai: aitextgen, fp32: torch.nn.Module, rounds: int) -> dict:
    for run in PATHS.values():  # warm-up: the views are made (unseeded: once it pays), the kernels chosen
        run(ai, fp32, 1, 60)
    table = {}
    for batch in (1, 8):
        times = {name: [] for name in PATHS}
        for _ in range(rounds):
            for name, run in PATHS.items():  # alternating: the machine's noise falls on every path alike
                start = time.perf_counter()
                run(ai, fp32, batch, NEW)
                times[name].append(time.perf_counter() - start)
        first = {}
        for name, run in PATHS.items():
            start = time.perf_counter()
            run(ai, fp32, batch, 1)
            first[name] = time.perf_counter() - start
        rates = {name: batch * NEW / statistics.median(t) for name, t in times.items()}
        table[batch] = {name: {"tokens/s": round(rate, 1), "x fp32": round(rate / rates["transformers fp32"], 2),
                               "first token s": round(first[name], 3)} for name, rate in rates.items()}
    return table


# VmHWM, this process's peak: ru_maxrss would also count the parent's size at the fork (Linux keeps it over exec)
MEMORY_RUN = """
import re, sys
from lowmem_aitextgen import aitextgen
ai = aitextgen(model_folder=sys.argv[1])
ai.generate(n=1, prompt="The meaning of", max_length=36, min_length=36, return_as_list=True, seed=1)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
"""


def peak_memory(size: str, dtype: str = "fp32") -> int:
    """Peak RSS of a new process generating from a random model of `size` saved as train() saves (one
    model.safetensors; save_pretrained would shard 1558M, which is read whole), in fp32 or (a LoRA run's
    output on a native-bf16 CPU) bf16."""
    with tempfile.TemporaryDirectory() as folder:
        made = aitextgen(config=GPT2Config(**SIZES[size]))
        if dtype == "bf16":
            made.model.to(torch.bfloat16)
        made.save(folder)
        del made
        result = subprocess.run([sys.executable, "-c", MEMORY_RUN, folder], capture_output=True, text=True,
                                check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        return int(result.stdout.strip().splitlines()[-1])


FIRST_CALL = """
import sys, time
from lowmem_aitextgen import aitextgen
start = time.perf_counter()
ai = aitextgen(model_folder=sys.argv[1])
length = 4 + int(sys.argv[3])  # the prompt's 4 tokens and the new ones
ai.generate(n=1, prompt="The meaning of", max_length=length, min_length=length, decoding=sys.argv[2],
            return_as_list=True)
print(time.perf_counter() - start)
"""


def first_call(size: str, rounds: int) -> dict[str, float]:
    """Seconds from aitextgen(model_folder=...) to the end of a first call of 1 and of 128 new tokens, in new
    processes, alternating: exact decoding (aitextgen's path: the weights read in fp32 on first use) against the
    default (decoding.py)."""
    times: dict[tuple[str, int], list[float]] = {(form, new): [] for new in (1, NEW) for form in ("exact", "auto")}
    with tempfile.TemporaryDirectory() as folder:
        aitextgen(config=GPT2Config(**SIZES[size])).save(folder)
        for _ in range(rounds):
            for form, new in times:
                result = subprocess.run([sys.executable, "-c", FIRST_CALL, folder, form, str(new)],
                                        capture_output=True, text=True, check=True)
                times[form, new].append(float(result.stdout.strip().splitlines()[-1]))
    return {f"decoding={form!r}, {new} tokens": round(statistics.median(t), 2) for (form, new), t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", nargs="*", default=["124M", "355M"])
    parser.add_argument("--memory", nargs="*", default=[])
    parser.add_argument("--first-call", nargs="*", default=[])
    parser.add_argument("--kinds", nargs="*", default=["fp32"], choices=["fp32", "bf16 folder", "prefix"])
    parser.add_argument("--saved-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--avx2-only", action="store_true",
                        help="our kernels shown an AVX2-only CPU's flags (the speeds in this process)")
    args = parser.parse_args()
    if args.avx2_only:
        flags = native.cpu_flags()
        native.cpu_flags = lambda: {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    report = {"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for size in args.sizes:
        for kind in args.kinds:
            report[f"{size}, {kind}"] = speeds(size, args.rounds, kind)
            print(json.dumps({f"{size}, {kind}": report[f"{size}, {kind}"]}), flush=True)
    for size in args.first_call:
        report[f"{size} first call s"] = first_call(size, args.rounds)
        print(json.dumps({size: report[f"{size} first call s"]}), flush=True)
    for size in args.memory:
        report[f"{size} ({args.saved_dtype}) peak RSS GiB"] = round(peak_memory(size, args.saved_dtype) / 2**30, 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
