"""A step's picks (sampling.next_tokens) for rows of generate()'s default settings (temperature 0.7, top_k 50) over
GPT-2's 50,257 logits: the rows picked together against each row picked alone (Row.next_token, how such rows were
picked before), alternating, the same picks; --generate: generate() end to end (a 355M GPT-2, random weights, 128
new tokens a text, seeded) with such rows picked together and a row at a time, alternating in one process, the same
texts.

    python benchmarks/sampling_speed.py --rows 1 8 16 --rounds 3
    python benchmarks/sampling_speed.py --generate --rows 8 16 --rounds 6

--settings: generate() end to end at each sampling setting against top_k=0 (a GPT-2 of GPT-2's 50,257 tokens, random
weights: --size toy, 2 layers 256 wide, where sampling is a third of a token's time, or 124M, GPT-2's smallest; one
text of 64 new tokens, seeded), a row per setting, alternating in one process: a top_k near the vocabulary's size, a
top_p near 1, min_p and typical_p must each cost no more than 1.5x top_k=0.

    python benchmarks/sampling_speed.py --settings top_k=50 top_k=1024 top_k=1025 top_k=10000 top_k=40000 \
        top_k=50256 top_p=0.9 top_p=0.999 top_k=40000,top_p=0.999 min_p=0.05 typical_p=0.95 --rounds 7 --size toy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from unittest import mock

import torch

from lowmem_aitextgen import hardware
from lowmem_aitextgen.generation.sampling import Row, RowSettings, next_tokens

PROMPT = "The meaning of a word is what it names"
A_ROW_AT_A_TIME = mock.patch.object(Row, "only_top_k", lambda row, vocabulary: False)  # next_tokens as it was

VOCABULARY, CALLS = 50257, 50


def per_call_ms(pick: Callable[[], list], calls: int = CALLS) -> float:
    """Milliseconds a call of `pick`, over `calls` calls after one."""
    pick()
    start = time.perf_counter()
    for _ in range(calls):
        pick()
    return (time.perf_counter() - start) / calls * 1e3


def picks(args: argparse.Namespace) -> None:
    """next_tokens's picks, together against a row at a time (module docstring)."""
    for count in args.rows:
        settings = [RowSettings(max_new=10**9, temperature=0.7, top_k=50, seed=i) for i in range(count)]
        together, alone = [Row(torch.tensor([1]), s) for s in settings], [Row(torch.tensor([1]), s) for s in settings]
        scores = torch.randn(count, VOCABULARY, generator=torch.Generator().manual_seed(count)) * 4
        assert next_tokens(together, scores, ()) == [row.next_token(scores[i], ()) for i, row in enumerate(alone)]
        paths = {"together": lambda: next_tokens(together, scores, ()),
                 "a row at a time": lambda: [row.next_token(scores[i], ()) for i, row in enumerate(alone)]}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for round_ in range(args.rounds):
            for name in sorted(paths, reverse=round_ % 2 == 1):
                times[name].append(per_call_ms(paths[name]))
        medians = {f"{name} ms": round(statistics.median(t), 3) for name, t in times.items()}
        print(json.dumps({"rows": count, **medians}), flush=True)


def generated(args: argparse.Namespace) -> None:
    """generate() end to end, the rows picked together against a row at a time (module docstring)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from generate_speed import saved_gpt2

    from lowmem_aitextgen import aitextgen

    paths = {"together": contextlib.nullcontext(), "a row at a time": A_ROW_AT_A_TIME}
    with tempfile.TemporaryDirectory() as folder:
        saved_gpt2("355M", folder)
        ai = aitextgen(model_folder=folder)
        for count in args.rows:
            ai.generate(n=count, prompt=PROMPT, max_new_tokens=8, return_as_list=True, seed=1)  # the view made
            speeds: dict[str, list[float]] = {name: [] for name in paths}
            texts: dict[str, list[str]] = {}
            for round_ in range(args.rounds):
                for name in sorted(paths, reverse=round_ % 2 == 1):
                    with paths[name]:
                        start = time.perf_counter()
                        texts[name] = ai.generate(n=count, prompt=PROMPT, max_new_tokens=128, min_new_tokens=128,
                                                  return_as_list=True, nonempty_output=False, seed=1)
                        speeds[name].append(count * 128 / (time.perf_counter() - start))
            print(json.dumps({"rows": count, **{f"{name} tok/s": round(statistics.median(v), 1)
                                                for name, v in speeds.items()},
                              "rounds' ratios": [round(a / b, 3) for a, b in zip(*speeds.values())],
                              "the same texts": texts["together"] == texts["a row at a time"]}), flush=True)


def per_setting(args: argparse.Namespace) -> None:
    """generate() at each setting of --settings against top_k=0 (module docstring)."""
    from transformers import GPT2Config

    from lowmem_aitextgen import aitextgen

    shape = {"toy": dict(n_layer=2, n_embd=256, n_head=4), "124M": dict(n_layer=12, n_embd=768, n_head=12)}[args.size]
    ai = aitextgen(config=GPT2Config(**shape, n_positions=256))
    settings = ["top_k=0", *args.settings]
    ai.generate(n=1, prompt=PROMPT, max_new_tokens=8, return_as_list=True, seed=1)  # the view made
    times: dict[str, list[float]] = {name: [] for name in settings}
    for round_ in range(args.rounds):
        for name in sorted(settings, reverse=round_ % 2 == 1):
            kwargs = {key: float(value) if "." in value else int(value)
                      for key, value in (pair.split("=") for pair in name.split(","))}
            start = time.perf_counter()
            ai.generate(n=1, prompt=PROMPT, max_new_tokens=64, min_new_tokens=64, temperature=1.0,
                        return_as_list=True, nonempty_output=False, seed=1, **{"top_k": 0, **kwargs})
            times[name].append((time.perf_counter() - start) / 64 * 1000)
    base = statistics.median(times["top_k=0"])
    for name in settings:
        median = statistics.median(times[name])
        print(json.dumps({"size": args.size, "setting": name, "ms a token": round(median, 2),
                          "against top_k=0": round(median / base, 2)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--generate", action="store_true", help="generate() end to end (module docstring)")
    parser.add_argument("--settings", nargs="+", help="generate() at each setting, e.g. top_k=40000 or "
                        "top_k=50,top_p=0.9, against top_k=0 (module docstring)")
    parser.add_argument("--size", choices=["toy", "124M"], default="toy", help="--settings' model (module docstring)")
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    (per_setting if args.settings else generated if args.generate else picks)(args)


if __name__ == "__main__":
    main()
