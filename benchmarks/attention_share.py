"""What a decoding step's attention costs (issue 54): the seeded default generate() of a GPT-2 (355M unless --size;
random weights: speed only), batch 1 and 8, each step's time and the part of it spent in
the stepping decoder's attention (its cache written, the scaled_dot_product_attention calls, the Python around
them), timed by wrapping Step._attend and the attention calls with a clock.

    python benchmarks/attention_share.py --rounds 3 --kv fp32 bf16

--kv names the engine's cache's dtypes, alternating (decoding.cache_dtype's choice set aside: bf16 where the CPU
computes bf16 natively); fp16 is measured, not a form the library takes (kv_cache.py's table).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.generation import engine, stepping

PROMPT = "The meaning of a word is what it names"

CACHES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --kv's dtypes (None: the activations')


class Clock:
    """Seconds spent in Step._attend and in the attention kernel, while `timing()` is on."""

    def __init__(self) -> None:
        self.attend = self.kernel = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        attend, sdpa = stepping.Step._attend, F.scaled_dot_product_attention

        def timed_attend(step: stepping.Step, *args: object, **kwargs: object) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return attend(step, *args, **kwargs)
            finally:
                self.attend += time.perf_counter() - start
                self.calls += 1

        def timed_kernel(*args: object, **kwargs: object) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return sdpa(*args, **kwargs)
            finally:
                self.kernel += time.perf_counter() - start

        with mock.patch.object(stepping.Step, "_attend", timed_attend), \
                mock.patch.object(F, "scaled_dot_product_attention", timed_kernel):
            yield


@contextlib.contextmanager
def cache_in(kv: str) -> Iterator[None]:
    """The engine's cache in `kv` whatever decoding.cache_dtype decides on this CPU: each view the engine decodes
    given that dtype (fp32: its activations' own)."""
    made = engine.as_decoder

    def as_decoder(model: object) -> engine.Decoder:
        decoder = made(model)
        return dataclasses.replace(decoder, cache_dtype=CACHES[kv]) if decoder.view else decoder

    with mock.patch.object(engine, "as_decoder", as_decoder):
        yield


def timed(ai: aitextgen, batch: int, new: int, kv: str) -> dict[str, float]:
    """One seeded call of `batch` texts of `new` tokens (the server's form: each token alone), the cache in `kv`."""
    clock = Clock()
    with cache_in(kv), clock.timing():
        start = time.perf_counter()
        ai.generate(n=batch, prompt=PROMPT, max_new_tokens=new, min_new_tokens=new, return_as_list=True,
                    nonempty_output=False, seed=1)
        seconds = time.perf_counter() - start
    return {"tokens/s": batch * new / seconds, "step ms": seconds / new * 1e3,
            "attention ms a step": clock.attend / new * 1e3, "its kernel ms a step": clock.kernel / new * 1e3,
            "us a layer's call": clock.attend / max(1, clock.calls) * 1e6}


def main() -> None:
    import generate_speed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(generate_speed.SIZES), default="355M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new", type=int, default=128, help="new tokens a text")
    parser.add_argument("--kv", choices=sorted(CACHES), nargs="+", default=["fp32", "bf16"],
                        help="the cache's dtypes, alternating round by round")
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    with tempfile.TemporaryDirectory() as folder:
        generate_speed.saved_gpt2(args.size, folder)
        ai = aitextgen(model_folder=folder)
        for batch in args.batches:
            rows: dict[str, list[dict[str, float]]] = {kv: [] for kv in args.kv}
            for round_ in range(args.rounds):
                for kv in (args.kv if round_ % 2 == 0 else args.kv[::-1]):
                    rows[kv].append(timed(ai, batch, args.new, kv))
            for kv, runs in rows.items():
                print(json.dumps({"size": args.size, "batch": batch, "kv": kv,
                                  **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}}),
                      flush=True)


if __name__ == "__main__":
    main()
