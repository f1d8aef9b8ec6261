"""torch.compile for the length of training: fewer kernel launches on a GPU (train(torch_compile=)).

At batch 1 a GPT-2 step on a large GPU is bound by kernel launches, not math (about 3% of an H100's
peak); compiling fuses each block's elementwise work into fewer kernels (nanoGPT: 250 -> 135 ms an
iteration).

| torch_compile=        | saves                                    | costs                                      |
|-----------------------|------------------------------------------|--------------------------------------------|
| False (the default)   | -                                        | -                                          |
| "blocks" (or True)    | launches and memory traffic inside each  | one compile at the first step, shared by   |
|                       | transformer block; one graph serves every| the model's identical blocks (regional     |
|                       | block                                    | compilation); embeddings and loss eager    |
| "model"               | the same across the model's body         | a longer compile; recompiles on new shapes |
|                       | (embeddings, every block, the last norm) |                                            |

Off by default everywhere.  On CPU it measured slower (124M, block 512, bf16, 2 cores: a step 2.06 s
eager, 2.26 s with each block compiled, 2.49 s with the whole model; the first step 13-46 s), so the
planner never compiles there; on GPUs it stays off until benchmarks/gpu_session.sh's compile rows say
otherwise.  The LM head and the loss stay eager either way: the chunked loss (chunked_loss.py) calls the
body and then the head chunk by chunk, never the model's own forward.  Generation after training runs
eager: the compiled wrappers come off when training ends.  A sharded model (strategy="fsdp", the offload
tier) is not compiled: FSDP2's per-block hooks would be traced with it, which nothing here tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from .callbacks import WhileTraining
from .checkpointing import transformer_blocks
from .chunked_loss import body_and_head

BACKEND = "inductor"  # torch.compile's own default; tests use "aot_eager": the same tracing, no C++ build


def compile_for_training(model: nn.Module, how: str) -> Callable[[], None]:
    """Compile each transformer block ("blocks") or the model's body ("model") in place; returns the undo."""
    parts = body_and_head(model)
    compiled = transformer_blocks(model) if how == "blocks" else [parts[0] if parts is not None else model]
    for module in compiled:
        module.compile(backend=BACKEND)

    def undo() -> None:
        for module in compiled:
            # nn.Module.compile keeps its wrapper here and has no public way to take it off
            module._compiled_call_impl = None

    return undo


class Compiled(WhileTraining):
    """The model compiled as the plan says (plan.torch_compile) from the first step to the end of training."""

    def __init__(self, how: str) -> None:
        super().__init__(partial(compile_for_training, how=how))
