"""Where a decoding token goes: torch.profiler's op table over the default seeded generate() call of a GPT-2
(random weights: time only), after a warm-up and two timed calls.

    python benchmarks/decode_profile.py --size 355M --batch 1 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from generate_speed import SIZES, ours, saved_gpt2  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from lowmem_aitextgen import aitextgen  # noqa: E402

PROMPT = "The meaning of a word is what it names"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="355M", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens of the profiled call")
    parser.add_argument("--rows", type=int, default=30, help="ops shown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        saved_gpt2(args.size, folder)
        ai, default = aitextgen(model_folder=folder), ours("auto", 1, PROMPT)  # seeded: the server's form
        default(ai, None, args.batch, 8)  # the view made, the kernels chosen
        for _ in range(2):
            start = time.perf_counter()
            default(ai, None, args.batch, 128)
            print(f"{args.batch * 128 / (time.perf_counter() - start):.1f} tokens/s, 128 new tokens unprofiled")
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            default(ai, None, args.batch, args.tokens)
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
