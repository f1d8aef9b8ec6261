"""The batch engine with rows coming and going, as the server runs it, in process: this checkout against another
(a git worktree of an earlier commit), alternating, so that a change to the engine, its cache or the stepping
decoder is measured in one run on this noisy machine.

    git worktree add /tmp/before HEAD~1
    python benchmarks/row_churn.py --against /tmp/before                 # 355M: 16 rows, then 1 row
    python benchmarks/row_churn.py --against /tmp/before --size 124M --jobs 8,64,32
    python benchmarks/row_churn.py --against /tmp/before --jobs 16,64,16,15      # a burst of 16 requests
    python benchmarks/row_churn.py --against /tmp/before --jobs 16,64,48,1,1     # unseeded requests' rows
    python benchmarks/row_churn.py --against /tmp/before --settings top_k=50 top_p=0.9   # each row's sampling

Each job `rows,new,total[,group[,sampled]]`: at most `rows` rows decode together, each of `new` tokens
(end-of-text impossible), new rows joining at the next step after one ends (up to `group` at once, 1 by default;
`16,64,16,15` is a server's burst: one row, then fifteen beside it), until `total` rows have run; `sampled` 1:
rows of unseeded requests, which need not be the same beside others (a seeded request's by default, each row's
attention computed alone, where the checkout has RowSettings.repeatable); tokens/s of each checkout,
the rounds alternating (each checkout in a process of its own, the model built once), medians of --rounds.
GPT-2 of the size (random weights, seed 0), the int8 form each token alone (the server's and a seeded call's).
`--settings`: RowSettings fields every row takes (numbers), e.g. generate()'s default top_k=50.

`--without-kernel`: every int8 product returns zeros at once (the kernel is not called), so what is timed is the
rest of a step (the engine, the stepping decoder, the elementwise operations, the cache, attention, sampling):
the part Python and small operations cost, which a change to them moves by a few percent of a whole step while
the products' speed here moves by a fifth between minutes (they read the weights from memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from generate_speed import SIZES  # noqa: E402

PROMPT = "The meaning of life is"


def without_kernel(view: object) -> None:
    """Each of the view's token-alone int8 Linears gives zeros in place of its kernel's products."""
    from lowmem_aitextgen.generation import int8_kernels

    for module in view.modules():
        if isinstance(module, int8_kernels.TokenwiseInt8Linear):
            module.product = lambda x, width=module.out_features: x.new_zeros(x.shape[0], width)


def worker(size: str, kernel: bool = True, settings: dict[str, int | float] | None = None) -> None:
    """Build the model and its view once; then, for each job read from stdin, print its tokens/s."""
    import torch
    from transformers import GPT2Config

    from lowmem_aitextgen import aitextgen
    from lowmem_aitextgen.generation import decoding
    from lowmem_aitextgen.generation.engine import Engine
    from lowmem_aitextgen.generation.sampling import Row, RowSettings

    torch.manual_seed(0)
    ai = aitextgen(config=GPT2Config(**SIZES[size]))
    view, tokenizer = decoding.decoding_model(ai.model, "int8", tokenwise=True), ai.tokenizer
    prompt, seeds = torch.tensor(tokenizer.encode(PROMPT)), iter(range(10**9))
    if not kernel:
        without_kernel(getattr(view, "model", view))  # a Decoder holds the view as .model

    def churn(rows: int, new: int, total: int, group: int = 1, sampled: int = 0) -> float:
        engine = Engine(view, tokenizer, (tokenizer.eos_token_id,))
        unseeded = {"repeatable": False} if sampled and "repeatable" in RowSettings.__dataclass_fields__ else {}

        def row() -> Row:
            return Row(prompt, RowSettings(max_new=new, min_new=new, seed=next(seeds), **unseeded, **(settings or {})))

        # as the server joins rows: within the next step where the engine can (admit), else between steps
        admit = getattr(engine, "admit", engine.join)

        def held() -> int:
            return engine.held if hasattr(engine, "held") else len(engine.rows)

        started, made, start = 1, 0, time.perf_counter()
        engine.join([row()])
        while held():
            made += sum(len(row.tokens) for row in engine.step())
            if started < total and held() < rows:
                joining = min(group, rows - held(), total - started)
                admit([row() for _ in range(joining)])
                started += joining
        return made / (time.perf_counter() - start)

    churn(4, 8, 4)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        print(round(churn(*map(int, line.split(","))), 2), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="another checkout of lowmem_aitextgen (a git worktree)")
    parser.add_argument("--size", default="355M", choices=SIZES)
    parser.add_argument("--jobs", nargs="*", default=["16,64,48", "1,64,2"],
                        help="rows,new,total[,group[,sampled]] each")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--without-kernel", action="store_true",
                        help="int8 products give zeros without the kernel: time the rest of a step (module docstring)")
    parser.add_argument("--settings", nargs="*", default=[], metavar="FIELD=NUMBER",
                        help="RowSettings fields of every row (module docstring)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = {field: float(value) if "." in value else int(value)
                for field, value in (setting.split("=", 1) for setting in args.settings)}
    if args.worker:
        return worker(args.worker, kernel=not args.without_kernel, settings=settings)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this checkout": here, "against": os.path.abspath(args.against)}
    flags = ["--without-kernel"] if args.without_kernel else []
    flags += ["--settings", *args.settings] if args.settings else []
    workers = {name: subprocess.Popen([sys.executable, __file__, "--against", tree, "--worker", args.size, *flags],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONPATH": tree})  # that tree's package first
               for name, tree in trees.items()}
    for process in workers.values():
        assert process.stdout.readline().strip() == "ready"
    for job in args.jobs:
        rates: dict[str, list[float]] = {name: [] for name in workers}
        for round_ in range(args.rounds):
            for name in list(workers)[::1 if round_ % 2 == 0 else -1]:
                workers[name].stdin.write(job + "\n")
                workers[name].stdin.flush()
                rates[name].append(float(workers[name].stdout.readline()))
        medians = {name: statistics.median(r) for name, r in rates.items()}
        print(json.dumps({"size": args.size, "kernel": not args.without_kernel, "settings": settings,
                          "job rows,new,total": job,
                          "tokens/s (medians)": medians,
                          "this / against": round(medians["this checkout"] / medians["against"], 3),
                          "rounds": rates}), flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()


if __name__ == "__main__":
    main()
