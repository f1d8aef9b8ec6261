"""The int8 matrix products torch offers on this CPU, per call, against ours (issue 54, item 2): a 355M GPT-2's
projections as a chain of 24 Linears (1024 -> 4096 -> 1024 ..., each weight its own, 100 MB of int8: read
from memory, as in decoding), at 1 and 16 rows.

    python benchmarks/int8_kernels.py

| path                      | what runs                                                                       |
|---------------------------|---------------------------------------------------------------------------------|
| ours                      | decoding.TokenwiseInt8Linear: fbgemm's given-scale kernel (torch.ao's ops)      |
| torch.ao dynamic          | quantize_dynamic's Linear: fbgemm's linear_dynamic (the unseeded form)          |
| torchao Int8DynAct        | torchao's Int8DynamicActivationInt8WeightConfig, eager (quantize_)               |
| torchao Int8DynAct, compiled | the same under torch.compile                                                  |
| pt2e x86 inductor         | torch.export, torchao's X86InductorQuantizer (dynamic), convert_pt2e, compiled  |
|                           | with inductor's freezing: oneDNN's int8 kernels                                  |
| fp32, bf16                | nn.Linear, for scale                                                             |

Reports µs a Linear (the chain's time over 24), the median of 5 runs of 10 chains, and each compiled path's
compile time.  A path that fails says why instead.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from lowmem_aitextgen import hardware
from lowmem_aitextgen.decoding import TokenwiseInt8Linear

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


def ours() -> nn.Module:
    return nn.Sequential(*(TokenwiseInt8Linear(linear) for linear in chain()))


def torch_ao_dynamic() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(chain(), {nn.Linear}, dtype=torch.qint8)


def torchao_eager() -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = chain()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
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


def compiled(model: nn.Module, x: torch.Tensor) -> tuple[Callable, float]:
    """`model` under torch.compile (inductor's freezing: weights folded, as the pt2e tutorial asks), and the
    seconds its first call took."""
    import torch._inductor.config as inductor

    inductor.freezing = True
    function = torch.compile(model)
    start = time.perf_counter()
    with torch.inference_mode():
        function(x)
    return function, round(time.perf_counter() - start, 1)


def main() -> None:
    print(json.dumps({"cpu": str(hardware.cpu()), "torch": torch.__version__, "threads": torch.get_num_threads()}))
    for rows in (1, 16):
        x = torch.randn(rows, WIDTH)
        makers: dict[str, Callable[[], tuple[Callable, float | None]]] = {
            "ours": lambda: (ours(), None),
            "torch.ao dynamic": lambda: (torch_ao_dynamic(), None),
            "torchao Int8DynAct": lambda: (torchao_eager(), None),
            "torchao Int8DynAct, compiled": lambda: compiled(torchao_eager(), x),
            "pt2e x86 inductor": lambda: compiled(pt2e(rows), x),
            "fp32": lambda: (chain(), None),
            "bf16": lambda: (copy.deepcopy(chain()).to(torch.bfloat16), None),
        }
        for name, make in makers.items():
            try:
                run, compile_s = make()
                xin = x.to(torch.bfloat16) if name == "bf16" else x
                row = {"rows": rows, "path": name, "µs a Linear": per_call(run, xin)}
                if compile_s is not None:
                    row["compile s"] = compile_s
            except Exception as failure:  # a path this torch cannot take: said, the others still measured
                row = {"rows": rows, "path": name, "failed": f"{type(failure).__name__}: {str(failure)[:300]}"}
            print(json.dumps(row, ensure_ascii=False), flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
