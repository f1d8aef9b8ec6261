"""The language-model loss computed a chunk of tokens at a time.

GPT-2's head turns every token into 50,257 logits: at block 1024 that is
206 MB in fp32 per sequence, held several times over by the standard loss
(16-bit logits, their fp32 copy, log-softmax, and the gradient of each).
Here each chunk's logits are made, reduced to a loss and dropped, so only
one chunk's logits ever exist.  Their gradients are known as soon as they are
(`_HeadCrossEntropy`): forward makes the gradient of the hidden states, and of
a trainable head's weight and bias, chunk by chunk, and backward scales them.
Nothing is recomputed, and the head's weight gradient is one buffer the chunks
add into.  A head that is not a plain nn.Linear (a LoRA-wrapped or quantized
head, one with hooks) must see its forward called: its chunks are
checkpointed, and backward recomputes their logits (the head's matmul twice).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _compat
from .plan import DEFAULT_CHUNK_TOKENS

IGNORE_INDEX = -100  # transformers' label value for "no loss here"


def body_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The transformer body (ids -> hidden states) and the LM head of a causal LM,
    or None where the model does not expose them (its own loss is used then)."""
    get_base_model = getattr(model, "get_base_model", None)  # a peft wrapper
    lm = get_base_model() if get_base_model is not None else model
    prefix = getattr(lm, "base_model_prefix", "")
    body = getattr(lm, prefix, None) if prefix else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(body, nn.Module) or not isinstance(head, nn.Linear):
        return None
    return body, head


class _HeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against `targets`, a chunk of tokens at a time,
    the gradients made in forward.

    The gradient of a summed cross-entropy as to the logits is ``softmax(logits) - one_hot(target)``, known
    as soon as the logits are; only the loss's incoming gradient (a scalar: the mean's 1/N, a loss scale)
    waits for backward, which scales what forward made.  Checkpointed chunks instead make every chunk's
    logits twice and, for a trainable head, a new vocab x dim weight gradient per chunk to be added up
    (measured on CPU: 355M at block 512, a full fine-tune's step 1.5x as long; benchmarks/RESULTS.md).
    A trainable head's weight gradient is kept from forward on, where backward would make it first anyway;
    estimate.py counts it with the gradients, so it is kept on ctx rather than among the saved tensors.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.parameter_dtype = weight.dtype
        # the head in the dtype it computes in, cast once for all chunks (not per chunk, or per recompute)
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 sums over the chunks, in the parameters' own dtype once in backward
        ctx.grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        ctx.grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, targets.numel(), chunk_tokens):
                chunk = hidden[start:start + chunk_tokens].to(dtype)
                target = targets[start:start + chunk_tokens]
                logits = F.linear(chunk, weight, bias).float()  # the softmax in fp32, as transformers' loss
                ignored = (target == IGNORE_INDEX).unsqueeze(1)
                picked = target.unsqueeze(1).masked_fill(ignored, 0)
                log_normalizer = torch.logsumexp(logits, dim=1, keepdim=True)
                total += (log_normalizer - logits.gather(1, picked)).masked_fill(ignored, 0.0).sum()
                if any(ctx.needs_input_grad[:3]):
                    _add_chunk_gradients(ctx, logits, log_normalizer, picked, ignored, chunk, weight,
                                         grad_hidden, start)
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        grads = [grad_hidden.mul_(grad_total.to(grad_hidden.dtype)) if grad_hidden is not None else None]
        for made in (ctx.grad_weight, ctx.grad_bias):
            grads.append(made.mul_(grad_total.float()).to(ctx.parameter_dtype) if made is not None else None)
        ctx.grad_weight = ctx.grad_bias = None
        return (*grads, None, None, None)


def _add_chunk_gradients(ctx, logits: torch.Tensor, log_normalizer: torch.Tensor, picked: torch.Tensor,
                         ignored: torch.Tensor, chunk: torch.Tensor, weight: torch.Tensor,
                         grad_hidden: torch.Tensor | None, start: int) -> None:
    """One chunk's share of the gradients (its logits are overwritten with theirs)."""
    grad_logits = logits.sub_(log_normalizer).exp_()  # softmax, in place of the logits
    # dtype given: under precision="bf16-true" Lightning makes bf16 the default dtype
    grad_logits.scatter_add_(1, picked, torch.full(picked.shape, -1.0, dtype=grad_logits.dtype, device=picked.device))
    grad_logits.masked_fill_(ignored, 0.0)
    if ctx.grad_bias is not None:
        ctx.grad_bias += grad_logits.sum(0)
    grad_logits = grad_logits.to(weight.dtype)
    if grad_hidden is not None:
        grad_hidden[start:start + len(chunk)] = grad_logits @ weight
    if ctx.grad_weight is not None:
        if weight.dtype == torch.float32:
            ctx.grad_weight.addmm_(grad_logits.t(), chunk)
        else:  # a 16-bit product, as autograd's would be, added up in fp32
            ctx.grad_weight += grad_logits.t() @ chunk


def _chunk_loss_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # the softmax in fp32, as transformers' loss does
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _is_plain_linear(head: nn.Module) -> bool:
    """A plain nn.Linear with no hooks: its math can be done for it.  A subclass (a quantized
    layer, a LoRA-wrapped head) or a hook must see its forward called."""
    return type(head) is nn.Linear and not (head._forward_hooks or head._forward_pre_hooks)


def _compute_dtype(weight: torch.Tensor, hidden: torch.Tensor) -> torch.dtype:
    """What a head computes in: autocast's dtype, else the hidden states' (a 16-bit frozen head computing in
    fp32, storage16.py)."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def chunked_lm_loss(
    hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> torch.Tensor:
    """Mean next-token cross-entropy, equal to transformers' causal-LM loss.

    hidden: (batch, seq, dim) final hidden states; labels: (batch, seq) token
    ids (IGNORE_INDEX where no loss), shifted here as transformers shifts them.
    """
    dim = hidden.shape[-1]
    hidden = hidden[:, :-1].reshape(-1, dim)
    targets = labels[:, 1:].reshape(-1)
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    if _is_plain_linear(head):
        return _HeadCrossEntropy.apply(hidden, head.weight, head.bias, targets, chunk_tokens,
                                       _compute_dtype(head.weight, hidden)) / count
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, head, hidden[start:end], targets[start:end], use_reentrant=False)
    return total / count


def final_hidden(model: nn.Module, body: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The body's final hidden states for `input_ids` and the labels they are scored against.

    Two kinds of model must run their own forward: a prompt-learning peft adapter (prefix, prompt tuning)
    works in its wrapper's forward (prefix keys and values, or virtual tokens before the text), and a
    sharded model (sharding.py) gathers its embeddings and head in its forward's hook.  That forward runs,
    asked for one position's logits only, and the body's output is taken on its way; virtual tokens get no
    label, the last of them predicts the text's first token, as peft scores it."""
    prompt_learning = getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False)
    if not (prompt_learning or _is_fsdp_module(model)):
        return body(input_ids=input_ids, use_cache=False).last_hidden_state, input_ids
    seen: list[torch.Tensor] = []
    hook = body.register_forward_hook(lambda module, args, output: seen.append(output.last_hidden_state))
    try:
        with _compat.without_warning(_compat.PEFT_PAST_KEY_VALUES, FutureWarning):
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = seen[-1]
    return hidden, F.pad(input_ids, (hidden.shape[1] - input_ids.shape[1], 0), value=IGNORE_INDEX)


def _is_fsdp_module(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, chunk_tokens: int | None) -> torch.Tensor:
    """The training loss of `model` on `input_ids` (labels = inputs), chunked if asked and possible."""
    parts = body_and_head(model) if chunk_tokens else None
    if parts is None:
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    body, head = parts
    hidden, labels = final_hidden(model, body, input_ids)
    return chunked_lm_loss(hidden, head, labels, chunk_tokens)
