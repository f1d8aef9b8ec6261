"""Our one-token attention and top-k kernels (native_attention.py, native_top_k.py) against torch's, per call and
end to end, alternating in one process; end to end also a step's GPT-2 blocks in one call (native_block.py) against
the stepping decoder's calls one by one, a top-k row's draw in one call against torch's calls, and the packed
weights in huge pages (huge_pages.py) against torch's 4 KiB pages.

    python benchmarks/native_kernels.py --calls
    python benchmarks/native_kernels.py --sizes 355M --batches 1 8 --rounds 4
    python benchmarks/native_kernels.py --sizes 355M --batches 1 8 --rounds 4 --form bf16

--calls: one layer's attention of 8 rows, 16 heads of 64 (355M's) over a cache of `places` (a bf16 and an fp32
cache, views into buffers with room), ours against what the stepping decoder did on torch's (the query to the
cache's dtype, scaled_dot_product_attention, transposed and back to fp32); and the top-51 of 8 and 1 rows of
50,257 logits.  End to end: generate() of 128 new tokens, seeded (the default form), with both kernels and the
blocks in one call, with the blocks' calls one by one (torch's layer norm), with torch's attention (and so calls one
by one), with torch's topk (and the draw on torch's calls), with the draw on torch's calls (ours' top-k), and
from a second object whose view was made with its weights in 4 KiB pages: tokens/s, the median of the rounds, and
the ratios; `--form bf16`: the same for a bf16 view (decoding="bf16").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from generate_speed import ours, saved_gpt2  # noqa: E402

from lowmem_aitextgen import aitextgen, hardware
from lowmem_aitextgen.generation import huge_pages
from lowmem_aitextgen.native import native_attention, native_block, native_top_k


def timed(call, repeats: int = 300) -> float:
    """Microseconds a call, after a warm-up."""
    for _ in range(20):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def calls() -> None:
    rows, heads, size = 8, 16, 64
    for dtype in (torch.bfloat16, torch.float32):
        for places in (17, 80, 144, 500):
            buffers = torch.randn(2, rows, heads, places + 64, size).to(dtype)
            keys, values = buffers[0, :, :, :places], buffers[1, :, :, :places]
            query = torch.randn(rows, 1, 3, heads, size).permute(2, 0, 3, 1, 4)[0]
            counts = torch.full((rows,), places, dtype=torch.int32)

            def theirs() -> torch.Tensor:
                out = F.scaled_dot_product_attention(query.to(dtype), keys, values, scale=0.125)
                return out.transpose(1, 2).reshape(rows, -1).float()

            print(f"attention, {str(dtype)[6:]} cache, {places} places: ours "
                  f"{timed(lambda: native_attention.attend(query, keys, values, counts, None, 0.125)):.1f} us, "
                  f"torch's {timed(theirs):.1f} us")
    logits = torch.randn(8, 50257) * 4
    for many in (8, 1):
        print(f"top-51 of {many} rows of 50,257: ours {timed(lambda: native_top_k.largest(logits[:many], 51)):.1f} us, "
              f"torch's {timed(lambda: logits[:many].topk(51)):.1f} us")


def end_to_end(sizes: list[str], batches: list[int], rounds: int, form: str) -> None:
    kept = native_attention.available, native_top_k.largest, native_block.available, native_top_k.draws
    available, largest, blocks, draws = kept
    variants = {"ours": (available, largest, blocks, draws, False),
                "blocks one by one": (available, largest, lambda: False, draws, False),
                "torch's attention": (lambda: False, largest, blocks, draws, False),
                "torch's topk": (available, lambda logits, k: logits.topk(k), blocks, lambda *args: None, False),
                "draw on torch's": (available, largest, blocks, lambda *args: None, False),
                "4 KiB pages": (available, largest, blocks, draws, True)}
    for size in sizes:
        with tempfile.TemporaryDirectory() as folder:
            saved_gpt2(size, folder)
            ai, small_pages, default = aitextgen(model_folder=folder), aitextgen(model_folder=folder), ours(form, 1)
            default(ai, None, 1, 1)
            with mock.patch.object(huge_pages, "available", lambda: False):  # this object's view: torch's pages
                default(small_pages, None, 1, 1)
            for batch in batches:
                default(ai, None, batch, 8)
                got: dict[str, list[float]] = {name: [] for name in variants}
                for _ in range(rounds):
                    for name, (*patches, small) in variants.items():
                        # (read at each call: the engine makes its Step, which reads native_block's, each call)
                        native_attention.available, native_top_k.largest, native_block.available, \
                            native_top_k.draws = patches
                        start = time.perf_counter()
                        default(small_pages if small else ai, None, batch, 128)
                        got[name].append(batch * 128 / (time.perf_counter() - start))
                native_attention.available, native_top_k.largest, native_block.available, native_top_k.draws = kept
                medians = {name: statistics.median(values) for name, values in got.items()}
                print(f"{size}, batch {batch}: " + "; ".join(
                    f"{name} {medians[name]:.1f} tok/s ({medians['ours'] / medians[name]:.3f}x)" for name in got))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", action="store_true")
    parser.add_argument("--sizes", nargs="*", default=["355M"])
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--form", default="auto", choices=["auto", "bf16"],
                        help="end to end: the default form (an int8 view), or decoding='bf16' (a bf16 view)")
    args = parser.parse_args()
    if not native_attention.available():
        sys.exit("our attention kernel does not run here (it needs AVX512F and gcc)")
    print(f"{hardware.cpu().name}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.calls:
        calls()
    else:
        end_to_end(args.sizes, args.batches, args.rounds, args.form)


if __name__ == "__main__":
    main()
