"""What a decoding step's attention costs (issue 54): the seeded default generate() of a GPT-2 (355M unless --size;
random weights: speed only), eager and compiled step, batch 1 and 8, each step's time and the part of it spent in
the stepping decoder's attention (its cache written, the scaled_dot_product_attention calls, the Python around
them), timed by wrapping Step._attend and the attention calls with a clock.

    python benchmarks/attention_share.py --rounds 2
    python benchmarks/attention_share.py --rounds 3 --kv fp32 bf16   # and a probe: the cache held in bf16

--kv bf16 (or fp16) is a probe of a form not built (its quality: kv_quality.py): the cache's buffers made in that
dtype, each query cast to it for the attention and its output back to fp32 (prompts too), by patching kv_cache's
buffers and row_attention's mask and entry point for this process.  The eager and the compiled step both call the
stepping decoder's attention, so the compiled step's check against the eager step still holds.  Only the stepping
decoder's path is patched: a prompt through transformers' forward (the exact form, a scored prompt) would meet a
16-bit cache unprepared.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from compiled_step import ALWAYS, NEVER, compiled_object, texts  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lowmem_aitextgen import hardware, kv_cache, row_attention, stepping  # noqa: E402

SIXTEEN = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the probe's dtypes


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
def sixteen_bit_cache(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """The probe of a cache in bf16 or fp16 (module docstring)."""
    masks = row_attention._masked_after  # (the function patched below)

    def buffers(keys: torch.Tensor, values: torch.Tensor, rows: int, places: int) -> torch.Tensor:
        return keys.new_empty(2, rows, keys.shape[1], places, keys.shape[-1], dtype=dtype)

    @functools.lru_cache(maxsize=row_attention.BLOCK)
    def masked_after(places: int, pad: int) -> torch.Tensor | None:
        mask = masks(places, pad)
        return None if mask is None else mask.to(dtype)

    @functools.lru_cache(maxsize=None)
    def together(heads: int, head_size: int) -> bool:
        """row_attention.together_exact, found once a call (its probe's rows are float32: the float32 masks)."""
        with mock.patch.object(row_attention, "_masked_after", masks):
            return row_attention.together_exact(heads, head_size)

    def each_row_alone(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, owns: list, window: int | None,
                       scale: float, after: object = None) -> torch.Tensor:
        cast = query.to(keys.dtype)
        if after is None:
            runs = [(row, row + 1, None) for row in range(len(owns))]
        else:  # as each_row_alone's float32 path: rows of one length together where the probe finds them exact
            runs = row_attention._runs(owns, window, together(query.shape[1], query.shape[-1]))
        return row_attention._in_runs(cast, keys, values, owns, window, scale, after, runs).to(query.dtype)

    with mock.patch.object(kv_cache, "_buffers", buffers), \
            mock.patch.object(row_attention, "_masked_after", masked_after), \
            mock.patch.object(stepping, "each_row_alone", each_row_alone):
        yield


def timed(ai: object, batch: int, new: int, step: str, kv: str) -> dict[str, float]:
    """One seeded call of `batch` texts of `new` tokens by the eager or compiled step with the cache in `kv`."""
    clock = Clock()
    cache = contextlib.nullcontext() if kv == "fp32" else sixteen_bit_cache(SIXTEEN[kv])
    with (ALWAYS if step == "compiled step" else NEVER), cache, clock.timing():
        start = time.perf_counter()
        texts(ai, batch, new)
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
    parser.add_argument("--kv", choices=["fp32", *SIXTEEN], nargs="+", default=["fp32"],
                        help="the cache's dtypes, alternating round by round (bf16, fp16: a probe)")
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    paths = [(step, kv) for step in ("eager", "compiled step") for kv in args.kv]
    with tempfile.TemporaryDirectory() as folder:
        generate_speed.saved_gpt2(args.size, folder)
        for batch in args.batches:
            ai = compiled_object(folder, batch)
            rows: dict[tuple[str, str], list[dict[str, float]]] = {path: [] for path in paths}
            for round_ in range(args.rounds):
                for path in (paths if round_ % 2 == 0 else paths[::-1]):
                    rows[path].append(timed(ai, batch, args.new, *path))
            for (step, kv), runs in rows.items():
                print(json.dumps({"size": args.size, "batch": batch, "kv": kv, "path": step,
                                  **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}}),
                      flush=True)
            del ai


if __name__ == "__main__":
    main()
