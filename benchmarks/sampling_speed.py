"""A step's picks (sampling.next_tokens) for rows of generate()'s default settings (temperature 0.7, top_k 50) over
GPT-2's 50,257 logits: the rows picked together against each row picked alone (Row.next_token, how such rows were
picked before), alternating, the same picks.

    python benchmarks/sampling_speed.py --rows 1 8 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from lowmem_aitextgen import hardware
from lowmem_aitextgen.sampling import Row, RowSettings, next_tokens

VOCABULARY, CALLS = 50257, 50


def per_call_ms(pick: Callable[[], list], calls: int = CALLS) -> float:
    """Milliseconds a call of `pick`, over `calls` calls after one."""
    pick()
    start = time.perf_counter()
    for _ in range(calls):
        pick()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
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


if __name__ == "__main__":
    main()
