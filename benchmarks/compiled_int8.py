"""What inductor's int8 GEMM template would give generate() end to end (issue 54, item 2): our default seeded
generate() against the same call with every projection of its int8 view (and the LM head) a torchao
Int8DynamicActivationInt8Weight Linear compiled alone with mode="max-autotune" (int8 activations per token, int8
weights per channel: inductor's C++ template, AMX or AVX-512 micro-kernels, in place of fbgemm's kernel),
355M (random weights: speed only), 128 new tokens, batch 1 and 8, alternating round by round.

    python benchmarks/compiled_int8.py --rounds 3

A probe of a form not built, not the form itself: the compiled view's rows are not their bits alone at one row
(inductor compiles a one-row call as a kernel of its own), its quality is not measured, and its compile time
(each Linear a graph, each new number of rows compiled again) is reported, not hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.generation import views


def compiled_linear(linear: nn.Linear, tokenwise: bool) -> nn.Module:
    """`linear` as a torchao int8 Linear (dynamic per-token activations) compiled with max-autotune (decoding's
    int8_linear's signature: `tokenwise` is what the plan asked, every row's activations are its own here)."""
    import torch._inductor.config as inductor
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    inductor.freezing = True  # weights folded into the graph: the template packs them once
    torch._dynamo.config.accumulated_recompile_limit = 100_000  # each Linear's graphs (own_code), all counted
    holder = nn.Sequential(linear.eval())  # (views.linear_of's Linear: its own contiguous weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(holder, Int8DynamicActivationInt8WeightConfig())
    return Compiled(torch.compile(own_code(holder[0]), mode="max-autotune"))


def own_code(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function calling `module` whose code object is its own: dynamo keeps its graphs per code object and
    checks a call against each kept graph's guards in turn (one code object for 97 Linears at four numbers of
    rows: ~390 graphs)."""
    scope: dict = {"module": module}
    exec(compile("def call(x):\n    return module(x)\n", f"<linear {id(module)}>", "exec"), scope)
    return scope["call"]


class Compiled(nn.Module):
    """A compiled Linear held out of the module tree (the view's maker would take its inner Linear for a
    projection still to quantize)."""

    each_token_alone = True  # the stepping decoder's rows attend alone, as in the default seeded form

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.__dict__["function"] = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


def main() -> None:
    import generate_speed
    from llamacpp_speed import timed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    seeded = generate_speed.ours("auto", 1)
    with tempfile.TemporaryDirectory() as folder:
        generate_speed.saved_gpt2("355M", folder)
        paths = {"ours, default": aitextgen(model_folder=folder), "int8 compiled, max-autotune":
                 aitextgen(model_folder=folder)}
        seeded(paths["ours, default"], None, 1, 8)
        with mock.patch.object(views, "int8_linear", compiled_linear):
            for batch in (1, 8):  # its view made, and each number of rows a step and a prompt has compiled
                start = time.perf_counter()
                seeded(paths["int8 compiled, max-autotune"], None, batch, 8)
                print(json.dumps({"compile and first call s, batch": batch,
                                  "s": round(time.perf_counter() - start, 1)}), flush=True)
        for batch in (1, 8):
            samples: dict[str, list[dict]] = {name: [] for name in paths}
            for round_ in range(args.rounds):
                for name in sorted(paths, reverse=round_ % 2 == 1):
                    ai = paths[name]
                    samples[name].append(timed(lambda b, n, ai=ai: seeded(ai, None, b, n), batch))
            for name, runs in samples.items():
                print(json.dumps({"size": "355M", "batch": batch, "path": name,
                                  **{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}}),
                      flush=True)


if __name__ == "__main__":
    main()
