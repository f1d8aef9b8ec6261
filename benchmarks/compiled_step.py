"""The compiled step (lowmem_aitextgen/compiled_step.py, issue 54) against the eager one and the references: the
default seeded generate() of a GPT-2 (355M unless --size; random weights: speed only), batch 1 and 8, alternating
round by round, the texts compared token for token; and (--bulk) generate_to_file as a user calls it, the rule deciding.

    python benchmarks/compiled_step.py --rounds 3 --references --no-repack
    python benchmarks/compiled_step.py --size 1558M --rounds 2 --references --no-repack
    python benchmarks/compiled_step.py --bulk 64 --length 256 --rounds 2

Timed rows: "ours, eager" is the library with compiling never paying (compiled_step.PAYS_AFTER out of reach),
"compiled step" the same call with it always paying, compiled before it is timed (the compile's time and memory
printed, not hidden).  One object a batch serves both (a view holds one graph, for one number of rows; the eager
step does not use it; its int8 view is read from the folder, its fp32 model never read), transformers' fp32
reference an object of its own, read once: 1558M's paths fit 24 GB beside the compile's peak.  --bulk:
generate_to_file(n=N, max_length=L, unseeded, its default batch) end to end, compile included, the library as
it is (its rule compiles where it pays) against compiling never paying: a fresh object each, alternating.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from lowmem_aitextgen import aitextgen, compiled_step, hardware  # noqa: E402
from lowmem_aitextgen.heap import release_freed_heap  # noqa: E402

PROMPT = "The meaning of a word is what it names"  # every path's, the references' too
NEVER = mock.patch.object(compiled_step, "PAYS_AFTER", {"one or two rows": 2**62, "more": 2**62})
ALWAYS = mock.patch.object(compiled_step, "PAYS_AFTER", {"one or two rows": 0, "more": 0})


def resident_mib() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def texts(ai: aitextgen, batch: int, new: int) -> list[str]:
    """The default seeded call's texts (the server's form: each token alone)."""
    return ai.generate(n=batch, prompt=PROMPT, max_new_tokens=new, min_new_tokens=new, return_as_list=True,
                       nonempty_output=False, seed=1)


def ours_path(ai: aitextgen, context: contextlib.AbstractContextManager) -> Callable[[int], dict[str, float]]:
    """A timed seeded call of `ai` (llamacpp_speed.timed: 128 new tokens, the first token's time) under `context`."""
    import generate_speed
    import llamacpp_speed

    seeded = generate_speed.ours("auto", 1, PROMPT)

    def run(batch: int) -> dict[str, float]:
        with context:
            return llamacpp_speed.timed(lambda b, n: seeded(ai, None, b, n), batch)
    return run


def references(folder: str, repack: bool) -> dict[str, Callable[[aitextgen, int], dict[str, float]]]:
    """transformers' fp32 generate() (an object of its own: reading the batch's object's fp32 model would make its
    view again, from the model, and drop its graph) and llama.cpp's Q8_0 of the same folder."""
    import generate_speed
    import llamacpp_speed

    source, bin_dir = llamacpp_speed.llamacpp(os.path.expanduser("~/.cache/lowmem_aitextgen/llamacpp"))
    gguf = llamacpp_speed.converted(source, folder, "q8_0")
    threads, reference = torch.get_num_threads(), aitextgen(model_folder=folder)
    return {
        "transformers fp32": lambda ai, batch: llamacpp_speed.timed(
            lambda b, n: generate_speed.transformers_fp32(reference, reference.model, b, n, PROMPT), batch),
        "llama.cpp Q8_0": lambda ai, batch: (llamacpp_speed.llama_bench(bin_dir, gguf, threads, repack) if batch == 1
                                             else llamacpp_speed.llama_batched(bin_dir, gguf, threads, batch, repack)),
    }


def compiled_object(folder: str, batch: int) -> aitextgen:
    """An object whose view's step is compiled for `batch` rows, its compiled texts checked against its eager ones
    (the compile's time and the resident memory it adds printed)."""
    ai = aitextgen(model_folder=folder)
    with NEVER:
        expected = texts(ai, batch, 128)
    start, before = time.perf_counter(), resident_mib()
    with ALWAYS:
        got = texts(ai, batch, 128)
    print(json.dumps({"batch": batch, "compile and first call s": round(time.perf_counter() - start, 1),
                      "resident MiB before": before, "after": resident_mib(),
                      "the same tokens as eager": got == expected}), flush=True)
    return ai


def timed_paths(folder: str, args: argparse.Namespace) -> None:
    """The seeded call's rows, a batch at a time: eager and compiled (module docstring), the references'."""
    paths: dict[str, Callable[[aitextgen, int], dict[str, float]]] = {
        "ours, eager": lambda ai, batch: ours_path(ai, NEVER)(batch),
        "compiled step": lambda ai, batch: ours_path(ai, ALWAYS)(batch)}
    if args.references:
        paths.update(references(folder, not args.no_repack))
    for batch in args.batches:
        ai = compiled_object(folder, batch)
        samples: dict[str, list[dict]] = {name: [] for name in paths}
        for round_ in range(args.rounds):
            for name in sorted(paths, reverse=round_ % 2 == 1):
                samples[name].append(paths[name](ai, batch))
        for name, runs in samples.items():
            print(json.dumps({"size": args.size, "batch": batch, "path": name,
                              **{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}}), flush=True)
        del ai
        gc.collect()
        release_freed_heap()
        print(json.dumps({"batch": batch, "resident MiB once its object is dropped": resident_mib(),
                          "graphs still held": len(compiled_step._GRAPHS)}), flush=True)


def bulk(folder: str, args: argparse.Namespace) -> None:
    """generate_to_file end to end, the rule deciding, against compiling never paying (module docstring)."""
    paths = {"generate_to_file, the library's rule": contextlib.nullcontext(), "never compiled": NEVER}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(args.rounds):
            for name in sorted(paths, reverse=round_ % 2 == 1):
                ai = aitextgen(model_folder=folder)
                start = time.perf_counter()
                with paths[name]:
                    ai.generate_to_file(n=args.bulk, max_length=args.length, destination_path=f"{out}/t.txt",
                                        prompt=PROMPT, min_length=args.length)
                seconds[name].append(time.perf_counter() - start)
                print(json.dumps({"round": round_, "path": name, "s": round(seconds[name][-1], 1),
                                  "compiled": any(g[1] is not None for g in compiled_step._GRAPHS.values())}),
                      flush=True)
                del ai
    for name, runs in seconds.items():
        print(json.dumps({"size": args.size, "texts": args.bulk, "length": args.length, "path": name,
                          "median s": round(statistics.median(runs), 1),
                          "texts/s": round(args.bulk / statistics.median(runs), 3)}), flush=True)


def main() -> None:
    import generate_speed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(generate_speed.SIZES), default="355M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--references", action="store_true", help="transformers' fp32 generate() and llama.cpp's "
                        "Q8_0 in the same rounds (llamacpp_speed.py's build and converter)")
    parser.add_argument("--no-repack", action="store_true", help="llama.cpp's --repack 0 (llamacpp_speed.py)")
    parser.add_argument("--bulk", type=int, default=0, help="time generate_to_file of this many texts instead")
    parser.add_argument("--length", type=int, default=256, help="--bulk: each text's max_length")
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    with tempfile.TemporaryDirectory() as folder:
        generate_speed.saved_gpt2(args.size, folder)
        (bulk if args.bulk else timed_paths)(folder, args)


if __name__ == "__main__":
    main()
