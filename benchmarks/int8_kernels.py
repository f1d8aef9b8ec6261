"""The int8 matrix products torch offers on this CPU, per call, against ours (issue 54, item 2): a 355M GPT-2's
projections as a chain of 24 Linears (1024 -> 4096 -> 1024 ..., each weight its own, 100 MB of int8: read
from memory, as in decoding), at 1, 8, 16 and 64 rows (`--rows`: a step of one text, of 8, of 16, a prompt);
--generate: our default seeded generate() end to end on each of our three kernels (int8_kernels.py) and in bf16,
355M, 128 new tokens, batch 1 and 8, alternating round by round.

    python benchmarks/int8_kernels.py
    python benchmarks/int8_kernels.py --rows 1 2 8 16 --paths ours "torch.ao"
    python benchmarks/int8_kernels.py --generate --rounds 3

| path                      | what runs                                                                       |
|---------------------------|---------------------------------------------------------------------------------|
| ours                      | int8_kernels.TokenwiseInt8Linear on the kernel product_kernel picks here         |
| ours, native <path>       | the same Linear on our kernel (native_int8.py), each path this CPU runs (avx2,   |
|                           | vnni, amx) forced                                                                |
| ours, fbgemm              | the same Linear on fbgemm's given-scale kernel (torch.ao's ops): the same bits   |
| ours, oneDNN              | the same Linear on oneDNN's qlinear_pointwise, called eagerly (the kernel pt2e  |
|                           | lowers to below; ours where torch.ao's ops are gone): the same bits             |
| torch.ao dynamic          | quantize_dynamic's Linear: fbgemm's linear_dynamic (the unseeded form on fbgemm) |
| torchao Int8DynAct        | torchao's Int8DynamicActivationInt8WeightConfig, eager (quantize_)               |
| torchao Int8DynAct, compiled | the same under torch.compile                                                  |
| ..., max-autotune         | the same compiled with mode="max-autotune": inductor's C++ GEMM template (AMX or |
|                           | AVX-512 micro-kernels) where it beats the aten kernel                            |
| torchao Int8WeightOnly,   | int8 weights, bf16 activations (not quantized), max-autotune: the template's     |
| bf16, max-autotune        | int8-weight GEMM                                                                 |
| pt2e x86 inductor         | torch.export, torchao's X86InductorQuantizer (dynamic), convert_pt2e, compiled  |
|                           | with inductor's freezing: oneDNN's int8 kernels                                  |
| fp32, bf16                | nn.Linear, for scale                                                             |

Reports µs a Linear (the chain's time over 24), the median of 5 runs of 10 chains, each compiled path's
compile time, and whether a row's output is the bits it gets alone (the seed rule's need: a text the same in any
batch; a compiled path compiles its one-row call anew).  A path that fails says why instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lowmem_aitextgen import hardware
from lowmem_aitextgen.generation import int8_kernels
from lowmem_aitextgen.generation.int8_kernels import FbgemmProduct, NativeProduct, OneDNNProduct, TokenwiseInt8Linear  # noqa: E402
from lowmem_aitextgen.native import native, native_int8

LAYERS, WIDTH, INNER = 24, 1024, 4096


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, INNER) if i % 2 == 0 else nn.Linear(INNER, WIDTH)
                           for i in range(LAYERS))).eval()


def per_call(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """µs a Linear: the median of 5 runs of 10 chains."""
    with torch.inference_mode():
        for _ in range(3):
            run(x)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                run(x)
            times.append((time.perf_counter() - start) / 10 / LAYERS * 1e6)
    return round(statistics.median(times), 1)


def ours(kernel: type | None = None) -> nn.Module:
    return nn.Sequential(*(TokenwiseInt8Linear(linear, kernel) for linear in chain()))


def native_on(path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The chain on our kernel, its path forced."""
    modules = list(ours(NativeProduct))

    def run(x: torch.Tensor) -> torch.Tensor:
        for module in modules:
            x = module.product.linear(x, module.bias, path)
        return x
    return run


def torch_ao_dynamic() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(chain(), {nn.Linear}, dtype=torch.qint8)


def torchao_eager() -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = chain()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


def torchao_weight_only() -> nn.Module:
    """torchao's int8 weights on a bf16 chain: its activations are bf16, not quantized."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = chain().to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    return model


def pt2e(rows: int) -> nn.Module:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    example = (torch.randn(rows, WIDTH),)
    exported = torch.export.export(chain(), example).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_dynamic=True))
    prepared = prepare_pt2e(exported, quantizer)
    prepared(*example)
    return convert_pt2e(prepared)


def compiled(model: nn.Module, x: torch.Tensor, mode: str | None = None) -> tuple[Callable, float]:
    """`model` under torch.compile in `mode` (inductor's freezing: weights folded, as the pt2e tutorial asks),
    and the seconds its first call took."""
    import torch._inductor.config as inductor

    inductor.freezing = True
    function = torch.compile(model, mode=mode)
    start = time.perf_counter()
    with torch.inference_mode():
        function(x)
    return function, round(time.perf_counter() - start, 1)


def row_is_own(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool | str:
    """Whether the first row's output among all of `x`'s is the bits it gets alone (why not known, where the path
    cannot take one row: an export of `x`'s shape)."""
    with torch.inference_mode():
        try:
            return torch.equal(run(x)[:1], run(x[:1]))
        except Exception as failure:  # said in the row
            return f"not known: {type(failure).__name__}"


def per_call_rows(all_rows: list[int], only: list[str] | None = None) -> None:
    """Each path's µs a Linear at each of `all_rows` rows (`only`: the paths whose names start so)."""
    for rows in all_rows:
        x = torch.randn(rows, WIDTH)
        x16 = x.to(torch.bfloat16)
        makers: dict[str, Callable[[], tuple[Callable, float | None]]] = {
            "ours": lambda: (ours(), None),
            **{f"ours, native {path}": (lambda path=path: (native_on(path), None)) for path in native_int8.cpu_paths()},
            "ours, fbgemm": lambda: (ours(FbgemmProduct), None),
            "ours, oneDNN": lambda: (ours(OneDNNProduct), None),
            "torch.ao dynamic": lambda: (torch_ao_dynamic(), None),
            "torchao Int8DynAct": lambda: (torchao_eager(), None),
            "torchao Int8DynAct, compiled": lambda: compiled(torchao_eager(), x),
            "torchao Int8DynAct, max-autotune": lambda: compiled(torchao_eager(), x, "max-autotune"),
            "torchao Int8WeightOnly, bf16, max-autotune": lambda: compiled(torchao_weight_only(), x16, "max-autotune"),
            "pt2e x86 inductor": lambda: compiled(pt2e(rows), x),
            "fp32": lambda: (chain(), None),
            "bf16": lambda: (copy.deepcopy(chain()).to(torch.bfloat16), None),
        }
        for name, make in makers.items():
            if only and not any(name.startswith(start) for start in only):
                continue
            try:
                run, compile_s = make()
                xin = x16 if "bf16" in name else x
                row = {"rows": rows, "path": name, "µs a Linear": per_call(run, xin)}
                if compile_s is not None:
                    row["compile s"] = compile_s
                if rows > 1:
                    row["a row's bits its own"] = row_is_own(run, xin)
            except Exception as failure:  # a path this torch cannot take: said, the others still measured
                row = {"rows": rows, "path": name, "failed": f"{type(failure).__name__}: {str(failure)[:300]}"}
            print(json.dumps(row, ensure_ascii=False), flush=True)
            torch._dynamo.reset()


def generate_rows(rounds: int) -> None:
    """Our default seeded generate() (355M, 128 new tokens) with its int8 view on each of our three kernels (each
    view made while product_kernel answers that kernel) and in bf16 (the form planned without torch.ao's ops
    before oneDNN's kernel, where bf16 is native), alternating: tokens/s, the median of rounds."""
    import tempfile

    import generate_speed
    from llamacpp_speed import timed
    from transformers import GPT2Config

    from lowmem_aitextgen import aitextgen

    kernels = {"ours": NativeProduct, "fbgemm": FbgemmProduct, "oneDNN": OneDNNProduct}
    if native.built() is None:
        del kernels["ours"]
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        aitextgen(config=GPT2Config(**generate_speed.SIZES["355M"])).save(folder)
        int8, bf16 = generate_speed.ours("auto", 1), generate_speed.ours("bf16", 1)
        paths = {**{f"int8 on {name}": (aitextgen(model_folder=folder), int8) for name in kernels},
                 "bf16": (aitextgen(model_folder=folder), bf16)}
        for name, kernel in kernels.items():
            with mock.patch.object(int8_kernels, "product_kernel", lambda kernel=kernel: kernel):
                int8(paths[f"int8 on {name}"][0], None, 1, 1)  # its view made on that kernel, kept for the calls below
        for batch in (1, 8):
            samples: dict[str, list[dict]] = {name: [] for name in paths}
            for round_ in range(rounds):
                for name in sorted(paths, reverse=round_ % 2 == 1):
                    ai, run = paths[name]
                    run(ai, None, batch, 8)
                    samples[name].append(timed(lambda b, n, ai=ai, run=run: run(ai, None, b, n), batch))
            for name, runs in samples.items():
                print(json.dumps({"size": "355M", "batch": batch, "path": f"ours, seeded, {name}",
                                  **{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}}),
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generate", action="store_true", help="generate() end to end on each of our kernels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64], help="rows a call (per call)")
    parser.add_argument("--paths", nargs="+", help="per call: only the paths whose names start so (\"ours\", ...)")
    args = parser.parse_args()
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    generate_rows(args.rounds) if args.generate else per_call_rows(args.rows, args.paths)


if __name__ == "__main__":
    main()
