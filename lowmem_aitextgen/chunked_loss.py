"""The language-model loss computed a chunk of tokens at a time.

GPT-2's head turns every token into 50,257 logits: at block 1024 that is
206 MB in fp32 per sequence, held several times over by the standard loss
(16-bit logits, their fp32 copy, log-softmax, and the gradient of each).
Here each chunk's logits are made, reduced to a loss and dropped, so only
one chunk's logits ever exist.  Backward needs them again:
- a trainable head: each chunk is checkpointed and backward recomputes its
  logits.  Trade-off: the head's matmul runs twice (about 1/7 of GPT-2 355M's
  forward FLOPs at block 1024);
- a frozen head (LoRA, freeze_layers): forward makes each chunk's gradient
  with its loss (`_FrozenHeadCrossEntropy`), and backward recomputes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import _compat
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


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` (a frozen head) against `targets`, a
    chunk of tokens at a time, the gradient of `hidden` made in forward.

    The gradient of a summed cross-entropy as to the logits is ``softmax(logits) -
    one_hot(target)``, known as soon as the logits are; only the loss's incoming gradient (a
    scalar: the mean's 1/N, a loss scale) waits for backward, which scales what forward kept
    (tokens x dim).  Checkpointed chunks instead make every chunk's logits twice.  A trainable head would have to keep its weight's gradient
    (vocab x dim) from forward on; it takes the checkpointed path.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the caller chose weight's dtype
            for start in range(0, targets.numel(), chunk_tokens):
                chunk = hidden[start:start + chunk_tokens].to(weight.dtype)
                target = targets[start:start + chunk_tokens]
                logits = F.linear(chunk, weight, bias).float()  # the softmax in fp32, as transformers' loss
                ignored = (target == IGNORE_INDEX).unsqueeze(1)
                picked = target.unsqueeze(1).masked_fill(ignored, 0)
                log_normalizer = torch.logsumexp(logits, dim=1, keepdim=True)
                total += (log_normalizer - logits.gather(1, picked)).masked_fill(ignored, 0.0).sum()
                if grad_hidden is not None:
                    grad_logits = logits.sub_(log_normalizer).exp_()  # softmax, in place of the logits
                    # dtype given: under precision="bf16-true" Lightning makes bf16 the default dtype
                    grad_logits.scatter_add_(1, picked, torch.full(picked.shape, -1.0, dtype=grad_logits.dtype,
                                                                   device=picked.device))
                    grad_logits.masked_fill_(ignored, 0.0)
                    grad_hidden[start:start + chunk_tokens] = grad_logits.to(weight.dtype) @ weight
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden.mul_(grad_total.to(grad_hidden.dtype)), None, None, None, None


def _chunk_loss_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # the softmax in fp32, as transformers' loss does
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _is_plain_linear(head: nn.Module) -> bool:
    """A plain nn.Linear with no hooks: its math can be done for it.  A subclass (a quantized
    layer, a LoRA-wrapped head) or a hook must see its forward called."""
    return type(head) is nn.Linear and not (head._forward_hooks or head._forward_pre_hooks)


def _in_compute_dtype(param: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """A head's weight or bias in autocast's dtype, else in the hidden states' where given (a 16-bit
    frozen head computing in fp32, storage16.py): cast once for all chunks."""
    device = param.device.type
    if torch.is_autocast_enabled(device):
        return param.to(torch.get_autocast_dtype(device))
    return param if hidden is None else param.to(hidden.dtype)


def _head_cast_once(head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head with its weight cast once for all chunks under autocast, else the head itself.

    Autocast would cast the weight in every chunk's recompute during backward (each recompute
    runs in a fresh autocast context, whose weight cache is empty) and upcast every chunk's
    gradient of it, GPT-2's 51M-parameter head each time.  Cast once, the chunks' bf16 gradients are summed in bf16 and upcast
    once.  Only a plain nn.Linear with no hooks of its own is bypassed like this: a subclass
    (a quantized layer) or a hook must see its forward called.
    """
    if not _is_plain_linear(head) or not torch.is_autocast_enabled(head.weight.device.type):
        return head
    return functools.partial(F.linear, weight=_in_compute_dtype(head.weight), bias=head.bias)


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
    frozen = not (head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad))
    if frozen and _is_plain_linear(head):
        weight = _in_compute_dtype(head.weight, hidden)
        bias = None if head.bias is None else _in_compute_dtype(head.bias, hidden)
        return _FrozenHeadCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens) / count
    head_function = _head_cast_once(head)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, head_function, hidden[start:end], targets[start:end],
                                   use_reentrant=False)
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
