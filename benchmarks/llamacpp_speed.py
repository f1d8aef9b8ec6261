"""Decoding speed against llama.cpp on the same saved folder, in one run, alternating (issue 54): ours (the
default plan, seeded: the int8 form each text the same in any batch, stepping.py's decoder) and transformers'
fp32 generate() (aitextgen's path) against llama.cpp's Q8_0 and F16 of the same weights; GPT-2 of each size
(random weights: speed only), 128 new tokens after a 16-token prompt, batch 1 and 8; tokens/s and time to
first token.

    python benchmarks/llamacpp_speed.py --sizes 124M 355M 1558M --rounds 3
    python benchmarks/llamacpp_speed.py --sizes 355M --rounds 3 --sixteen   # ours in bf16 against F16
    python benchmarks/llamacpp_speed.py --sizes 1558M --rounds 6 --sixteen --only "ours, bf16" "llama.cpp F16" \
        --batches 1   # a few paths, alternating longer

llama.cpp comes from llama-cpp-python's source distribution (pip downloads it into --work, kept between
runs): its vendored llama.cpp is built with cmake (llama-bench, llama-batched-bench; a few minutes on 2 cores,
-march=native) and its convert_hf_to_gguf.py converts each saved folder to F16 and Q8_0.  llama.cpp's batch 1
is llama-bench's tg128 (and pp16 for the first token: the prompt's time plus one token's); its batch 8 is
llama-batched-bench's 8 parallel sequences (S_TG).  Both use every core (-t: torch's thread count).  Both count
decoding alone (no prompt, no setup): ours' "decode tokens/s" counts the same (the tokens after the first over the
call's time past a call of one), its "tokens/s" the whole generate() call's (prompt, setup, text included).
--no-repack passes llama.cpp's own switch that keeps its weights as loaded: on a CPU with AMX its build repacks
Q8_0 for AMX tiles, and on the Intel Xeon VM of 2026-12-01 that path dies of SIGILL at its first tile instruction
(tilezero, in a worker thread), so llama.cpp is measured there on its AVX512-VNNI kernels.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from generate_speed import SIZES, ours, saved_gpt2, transformers_fp32  # noqa: E402

from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.native import native_bf16

NEW, PROMPT_TOKENS = 128, 16
BINARIES = ("llama-bench", "llama-batched-bench")


def llamacpp(work: str) -> tuple[str, str]:
    """llama.cpp's source (from llama-cpp-python's sdist) built in `work`: its folder and the build's bin/."""
    sources = glob.glob(os.path.join(work, "llama_cpp_python-*/vendor/llama.cpp"))
    if not sources:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", work], check=True)
        with tarfile.open(glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))[0]) as archive:
            archive.extractall(work, filter="data")
        sources = glob.glob(os.path.join(work, "llama_cpp_python-*/vendor/llama.cpp"))
    source, build = sources[0], os.path.join(sources[0], "build")
    if not all(os.path.exists(os.path.join(build, "bin", b)) for b in BINARIES):
        subprocess.run(["cmake", "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], cwd=source, check=True)
        subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count()), "--target", *BINARIES], check=True)
    return source, os.path.join(build, "bin")


def converted(source: str, folder: str, outtype: str) -> str:
    """The saved `folder` as GGUF in `outtype` (f16, q8_0), by llama.cpp's own converter."""
    out = os.path.join(folder, f"model-{outtype}.gguf")
    config_file = os.path.join(folder, "config.json")
    with open(config_file, encoding="utf-8") as file:
        config = json.load(file)
    if "n_ctx" not in config:  # the converter reads GPT-2's n_ctx, which transformers 5 no longer writes
        with open(config_file, "w", encoding="utf-8") as file:
            json.dump({**config, "n_ctx": config["n_positions"]}, file)
    if not os.path.exists(out):
        env = {**os.environ, "PYTHONPATH": os.path.join(source, "gguf-py")}
        subprocess.run([sys.executable, os.path.join(source, "convert_hf_to_gguf.py"), folder, "--outtype", outtype,
                        "--outfile", out], check=True, env=env, capture_output=True)
    return out


def llama_bench(bin_dir: str, gguf: str, threads: int, repack: bool = True) -> dict[str, float]:
    """llama-bench's batch 1: tokens/s over 128 new tokens, and a 16-token prompt's first token (seconds)."""
    result = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-p", str(PROMPT_TOKENS), "-n",
                             str(NEW), "-t", str(threads), "-r", "1", "-o", "json", "--repack", str(int(repack))],
                            capture_output=True, text=True, check=True)
    rows = json.loads(result.stdout)
    decode = next(r for r in rows if r["n_gen"] > 0)["avg_ts"]
    prompt = next(r for r in rows if r["n_prompt"] > 0)["avg_ts"]
    return {"tokens/s": decode, "first token s": PROMPT_TOKENS / prompt + 1 / decode, "decode tokens/s": decode}


def llama_batched(bin_dir: str, gguf: str, threads: int, batch: int, repack: bool = True) -> dict[str, float]:
    """llama-batched-bench's `batch` parallel sequences: their tokens/s together over 128 new tokens each."""
    result = subprocess.run([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-c", str(batch * 256),
                             "-npp", str(PROMPT_TOKENS), "-ntg", str(NEW), "-npl", str(batch), "-t", str(threads),
                             "--output-format", "jsonl", *([] if repack else ["--no-repack"])],
                            capture_output=True, text=True, check=True)
    row = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    return {"tokens/s": row["speed_tg"], "first token s": row["t_pp"] + row["t_tg"] / NEW,
            "decode tokens/s": row["speed_tg"]}


def prompt_text(ai: aitextgen) -> str:
    """A text of PROMPT_TOKENS tokens."""
    ids = ai.tokenizer("The meaning of a word is what it names, and the names of")["input_ids"]
    ids = (ids * PROMPT_TOKENS)[:PROMPT_TOKENS]
    return ai.tokenizer.decode(ids)


def timed(run: Callable[[int, int], None], batch: int) -> dict[str, float]:
    """tokens/s of one call of NEW tokens a text (the whole call's), seconds to one new token (a call of one), and
    the decoding's tokens/s: the NEW - 1 tokens after the first over the time the call took past a call of one (as
    llama.cpp's tg and S_TG count: no prompt, no setup)."""
    start = time.perf_counter()
    run(batch, 1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    run(batch, NEW)
    took = time.perf_counter() - start
    return {"tokens/s": batch * NEW / took, "first token s": first,
            "decode tokens/s": batch * (NEW - 1) / (took - first)}


def sixteen_bit_paths(folder: str, prompt: str, chosen: Callable[[str], bool]
                      ) -> dict[str, Callable[[int, int], None]]:
    """--sixteen: ours asked for decoding="bf16" (against llama.cpp's F16), its projections packed for our bf16
    kernel where it runs (native_bf16.py), beside the same packed for oneDNN (packed16.py; ours hidden while that
    object's view is made); elsewhere packed for oneDNN beside not packed (its ops hidden).  Two objects of their
    own (three of 1558M pass 24 GiB); those `chosen` (by name) alone."""
    bf16, paths = ours("bf16", 1, prompt), {}
    if chosen("ours, bf16"):
        first = aitextgen(model_folder=folder)
        bf16(first, None, 1, 1)  # the view made here
        paths["ours, bf16"] = lambda b, n: bf16(first, None, b, n)
    other = "ours, bf16 on oneDNN" if native_bf16.available() else "ours, bf16 not packed"
    if chosen(other):
        second = aitextgen(model_folder=folder)
        hidden = (native_bf16, "available", lambda: False) if native_bf16.available() else \
            (hardware, "PACKED_OPS", (*hardware.PACKED_OPS, "hidden"))
        with mock.patch.object(*hidden):
            bf16(second, None, 1, 1)
        paths[other] = lambda b, n: bf16(second, None, b, n)
    return paths


def size_rows(size: str, rounds: int, source: str, bin_dir: str, fp32_up_to: int, sixteen: bool = False,
              repack: bool = True, only: list[str] | None = None, batches: tuple[int, ...] = (1, 8)
              ) -> Iterator[dict]:
    """Every path's medians for one size, at each of `batches`, the paths alternating within each round; `only`:
    the paths of these names (the others not made)."""
    threads = torch.get_num_threads()
    chosen = (lambda name: True) if not only else (lambda name: name in only)
    with tempfile.TemporaryDirectory() as folder:
        saved_gpt2(size, folder)
        ggufs = {f"llama.cpp {name.upper()}": converted(source, folder, name) for name in ("q8_0", "f16")
                 if chosen(f"llama.cpp {name.upper()}")}
        ai = aitextgen(model_folder=folder)
        prompt = prompt_text(ai)
        default = ours("auto", 1, prompt)  # seeded: the int8 form each text the same in any batch
        ours_paths: dict[str, Callable[[int, int], None]] = {"ours, default": lambda b, n: default(ai, None, b, n)}
        if SIZES[size]["n_layer"] <= fp32_up_to and chosen("transformers fp32"):  # an object of its own: reading
            reference = aitextgen(model_folder=folder)  # ai.model would load the fp32 model, and ours would make
            ours_paths["transformers fp32"] = lambda b, n: transformers_fp32(reference, reference.model, b, n,
                                                                             prompt)  # its view again from it
        if sixteen:
            ours_paths.update(sixteen_bit_paths(folder, prompt, chosen))
        ours_paths = {name: run for name, run in ours_paths.items() if chosen(name)}
        for batch in batches:
            if "ours, default" in ours_paths:
                default(ai, None, batch, 8)  # warm-up: the view made, the kernels chosen
            samples: dict[str, list[dict]] = {name: [] for name in [*ours_paths, *ggufs]}
            for _ in range(rounds):
                for name, run in ours_paths.items():
                    samples[name].append(timed(run, batch))
                for name, gguf in ggufs.items():
                    samples[name].append(llama_bench(bin_dir, gguf, threads, repack) if batch == 1 else
                                         llama_batched(bin_dir, gguf, threads, batch, repack))
            for name, runs in samples.items():
                yield {"size": size, "batch": batch, "path": name,
                       **{key: round(statistics.median(s[key] for s in runs), 3) for key in runs[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["124M", "355M", "1558M"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default=os.path.expanduser("~/.cache/lowmem_aitextgen/llamacpp"))
    parser.add_argument("--fp32-up-to", type=int, default=24, help="transformers' fp32 for models of at most "
                        "this many layers (1558M's fp32 generate() takes minutes a round)")
    parser.add_argument("--sixteen", action="store_true", help="ours in bf16 too (decoding='bf16', packed and "
                        "not), against llama.cpp's F16: a CPU with native bf16")
    parser.add_argument("--no-repack", action="store_true", help="llama.cpp's weights kept as loaded (its "
                        "--repack 0): its AMX repacking dies of SIGILL on some VMs (module docstring)")
    parser.add_argument("--only", nargs="*", help="these paths alone, by name (e.g. 'ours, bf16' 'llama.cpp F16'): "
                        "a longer alternation of a few paths")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--out", default=None, help="a JSONL file the rows are appended to")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    source, bin_dir = llamacpp(args.work)
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    for size in args.sizes:
        for row in size_rows(size, args.rounds, source, bin_dir, args.fp32_up_to, args.sixteen, not args.no_repack,
                             args.only, tuple(args.batches)):
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
