"""A/B of two checkouts' generate(): the default seeded call's tokens/s, each checkout in processes of its own,
alternating (A B, B A, ...), on one saved GPT-2 (random weights: speed only).

    git worktree add /tmp/base <commit>
    python benchmarks/ab_checkouts.py /tmp/base . --batch 1 --rounds 6

On the shared 2-core machines here the same call's speed moves by 1.5-2x within minutes (HISTORY.md, twenty-fourth
session); processes alternating see the same phases, so the medians and the paired ratios separate changes of a
few percent.  Each process loads the folder, warms up (8 tokens), and reports the faster of two calls of 128 new
tokens after a 16-token prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from generate_speed import saved_gpt2  # noqa: E402

ONE_CHECKOUT = r'''
import json, sys, time
import lowmem_aitextgen
from lowmem_aitextgen import aitextgen
checkout, folder, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
assert lowmem_aitextgen.__file__.startswith(checkout), lowmem_aitextgen.__file__
ai = aitextgen(model_folder=folder)
prompt = "The meaning of a word is what it names, and the names of"
call = dict(n=batch, prompt=prompt, return_as_list=True, nonempty_output=False, seed=1)
ai.generate(max_new_tokens=8, min_new_tokens=8, **call)
speeds = []
for _ in range(2):
    start = time.perf_counter()
    ai.generate(max_new_tokens=128, min_new_tokens=128, **call)
    speeds.append(batch * 128 / (time.perf_counter() - start))
print(json.dumps(max(speeds)))
'''


def speed(checkout: str, folder: str, batch: int) -> float:
    """tokens/s of `checkout`'s generate() in a process of its own (its package first on the path)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    done = subprocess.run([sys.executable, "-c", ONE_CHECKOUT, checkout, folder, str(batch)], cwd=checkout,
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="the first checkout (the base)")
    parser.add_argument("b", help="the second checkout (the change)")
    parser.add_argument("--size", default="355M")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    a, b = os.path.realpath(args.a), os.path.realpath(args.b)
    samples: dict[str, list[float]] = {a: [], b: []}
    with tempfile.TemporaryDirectory() as folder:
        saved_gpt2(args.size, folder)
        for round_ in range(args.rounds):
            for checkout in (a, b) if round_ % 2 == 0 else (b, a):
                samples[checkout].append(speed(checkout, folder, args.batch))
    medians = {checkout: statistics.median(runs) for checkout, runs in samples.items()}
    print(json.dumps({"size": args.size, "batch": args.batch, "a": args.a, "b": args.b,
                      "a tokens/s": [round(s, 1) for s in samples[a]], "b tokens/s": [round(s, 1) for s in samples[b]],
                      "b / a (medians)": round(medians[b] / medians[a], 3),
                      "b / a (paired)": [round(y / x, 3) for x, y in zip(samples[a], samples[b])]}))


if __name__ == "__main__":
    main()
