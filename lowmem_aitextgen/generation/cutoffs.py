"""What top_k, top_p, typical_p and min_p keep of a row of logits: transformers' own warpers (their checks, their
attributes, their answers), each cut found without sorting the vocabulary.

transformers' TopP and Typical warpers sort the whole row, its TopK takes torch's topk, which sorts past a few
thousand, and its MinP a topk of one: over GPT-2's 50,257 logits a sort costs ~4 ms on the CPU, several times a
small model's step (RESULTS.md: top_p 0.999 and typical_p 0.95 6.1-6.4x top_k=0's time a token, before).  Each
class here is the transformers warper of its name with the same cut found by native_top_k.mass_cuts (two reads of
the row, a sort of one bucket of it), or by a compare where no order is needed:

| warper  | keeps                                                  | the cut found by                | apart from theirs  |
|---------|--------------------------------------------------------|---------------------------------|--------------------|
| TopK    | the logits at or above the k-th largest                | kth_largest                     | never              |
| TopP    | the likeliest until their probability reaches top_p    | mass_cuts over -logits, by p    | at the edge (1, 2) |
| Typical | the least surprising, abs(-log p - entropy), until     | mass_cuts over those, by p      | at the edge (1)    |
|         | their probability reaches typical_p                    |                                 |                    |
| MinP    | probabilities at or above min_p x the largest          | a compare (the likeliest stays) | never              |

(1) where the probability before a token is within rounding of the mass: summed in float64 here, in float32 in
their sorted order there.  (2) Tokens of one logit straddling the mass are all kept, as TopK and Typical keep a
tie; TopP keeps those its sort happens to put first.  Where our kernels are not built, a row holds NaN, or a warper keeps more than its
default one token (min_tokens_to_keep): transformers' own call.
"""

from __future__ import annotations

import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper

from ..native import native_top_k

# the largest k whose k-th our top-k kernel selects (native_top_k.largest) rather than a cut of counts finds
SELECTED_MAX_K = 512


def kth_largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The `k`-th largest of each row of `logits` (rows, n), as a column (rows, 1), as torch's topk finds it: on our
    top-k kernel up to SELECTED_MAX_K, by a cut of counts past it (native_top_k.mass_cuts); else by torch's
    kthvalue (one pass), or its topk where a row holds NaN (topk takes NaN as the largest)."""
    if k <= SELECTED_MAX_K:
        return native_top_k.largest(logits, k)[0][:, k - 1:]
    cut = native_top_k.mass_cuts(logits, None, [float(k)] * logits.shape[0], descending=True)
    if cut is not None:
        return cut[0][:, None]
    if logits.isnan().any():
        return logits.topk(k)[0][:, k - 1:]
    return logits.kthvalue(logits.shape[-1] - k + 1, dim=-1, keepdim=True).values


def kth_and_next(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k`-th and the (k + 1)-th largest of each row of `logits` (rows, n; k < n), as columns, as kth_largest
    finds them (the next by the same cut: its key after)."""
    if k + 1 <= SELECTED_MAX_K:
        values = native_top_k.largest(logits, k + 1)[0]
        return values[:, k - 1:k], values[:, k:k + 1]
    cut = native_top_k.mass_cuts(logits, None, [float(k)] * logits.shape[0], descending=True)
    if cut is not None:
        return cut[0][:, None], cut[1][:, None]
    return kth_largest(logits, k), kth_largest(logits, k + 1)


def _removed_by_mass(keys: torch.Tensor, probabilities: torch.Tensor, masses: list[float], descending: bool
                     ) -> torch.Tensor | None:
    """Where each row's items, in the order of `keys`, come after the first whose cumulative probability reaches
    the row's mass (a tie with it stays, as in transformers' Typical); None where the kernel does not take them."""
    cut = native_top_k.mass_cuts(keys.contiguous(), probabilities.contiguous(), masses, descending)
    if cut is None:
        return None
    return keys < cut[0][:, None] if descending else keys > cut[0][:, None]


class TopK(TopKLogitsWarper):
    """transformers' TopKLogitsWarper, the k-th largest by kth_largest."""

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        if self.top_k >= scores.shape[-1]:
            return scores  # (nothing is below the least)
        return scores.masked_fill(scores < kth_largest(scores, self.top_k), self.filter_value)


class TopP(TopPLogitsWarper):
    """transformers' TopPLogitsWarper (min_tokens_to_keep 1), its cut by mass_cuts."""

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        removed = None
        if self.min_tokens_to_keep == 1 and scores.dtype == torch.float32:
            removed = _removed_by_mass(scores, scores.softmax(-1), [self.top_p] * len(scores), descending=True)
        if removed is None:
            return super().__call__(input_ids, scores)
        return scores.masked_fill(removed, self.filter_value)


class Typical(TypicalLogitsWarper):
    """transformers' TypicalLogitsWarper (min_tokens_to_keep 1), its shifted scores as it computes them, its cut by
    mass_cuts."""

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        removed = None
        if self.min_tokens_to_keep == 1 and scores.dtype == torch.float32:
            normalized = torch.nn.functional.log_softmax(scores, dim=-1)
            p = torch.exp(normalized)
            entropy = -(normalized * p).nansum(-1, keepdim=True)
            shifted = (normalized + entropy).abs_()  # (their abs((-normalized) - entropy), bit for bit, one copy)
            removed = _removed_by_mass(shifted, p, [self.mass] * len(scores), descending=False)
        if removed is None:
            return super().__call__(input_ids, scores)
        return scores.masked_fill(removed, self.filter_value)


class MinP(MinPLogitsWarper):
    """transformers' MinPLogitsWarper (min_tokens_to_keep 1) without its topk: the likeliest token's probability
    is at or above min_p (at most 1) times itself, so it always stays."""

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        if self.min_tokens_to_keep != 1:
            return super().__call__(input_ids, scores)
        probabilities = torch.softmax(scores, dim=-1)
        removed = probabilities < self.min_p * probabilities.amax(dim=-1, keepdim=True)
        return scores.masked_fill(removed, self.filter_value)
