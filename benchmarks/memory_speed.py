"""Peak memory and tokens/s of one 355M GPT-2 fine-tuning configuration per process.

    python benchmarks/memory_speed.py                 # CPU, block 512, every configuration
    python benchmarks/memory_speed.py --device gpu    # GPU, block 1024
    python benchmarks/memory_speed.py --only ours_lora   # one configuration
    python benchmarks/memory_speed.py --device gpu --peers  # + transformers' Trainer beside ours
    python benchmarks/memory_speed.py --rounds 3       # each configuration 3 times, in turn
    python benchmarks/memory_speed.py --references --rounds 2  # ours against the recipe and the Trainer
    bash benchmarks/gpu_session.sh targets            # on a lent GPU machine: what RESULTS.md reports

Each configuration runs in a fresh subprocess (so peaks do not mix), trains
`--steps` optimizer steps at batch 1 on Python's documentation text with the
GPT-2 tokenizer, and reports:
  peak_train  — CPU: peak RSS from the first training step on (the kernel's
                high-water mark is reset after the model is built);
                GPU: torch.cuda.max_memory_allocated over training
  peak_process — CPU: whole-process peak RSS, model construction included
  tokens_per_s — over the steps after the first (warm-up) step
  estimate_bytes — for our rows, estimate_memory() of the plan train() chose
The baseline is aitextgen 0.6.0's recipe written as a plain PyTorch loop:
fp32, eager attention, no checkpointing, full fine-tune, torch's default AdamW.
The peers (--peers, --references) are transformers' Trainer at its best memory settings on the
same model, data, block and batch: bf16 where native (else fp32), gradient checkpointing, SDPA, and
optim="adamw_torch" / "adamw_torch_8bit" (torchao's, as ours) / a peft LoRA
model with our rank, alpha, dropout and targets on a bf16 base.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    # name: (description, train() keyword arguments or None for the plain baseline loop, attention)
    "baseline": ("aitextgen 0.6 recipe (fp32, eager, no ckpt, full FT)", None, "eager"),
    "sdpa": ("SDPA attention alone", dict(precision="32-true", gradient_checkpointing=False), "sdpa"),
    "checkpointing": ("checkpointing alone", dict(precision="32-true", gradient_checkpointing=True), "eager"),
    "bf16": ("bf16-mixed alone", dict(precision="bf16-mixed", gradient_checkpointing=False), "eager"),
    "lora_alone": ("LoRA r=8 alone (fp32)", dict(precision="32-true", gradient_checkpointing=False, lora=True),
                   "eager"),
    "ours_full": ("lowmem defaults, full fine-tune", dict(), "sdpa"),
    "ours_lora": ("lowmem defaults, lora=True", dict(lora=True), "sdpa"),
    "ours_full_8bit": ("lowmem defaults, optimizer='adamw8bit'", dict(optimizer="adamw8bit"), "sdpa"),
    "ours_max_4gib": ("lowmem, max_memory='4GiB' (full fine-tune)", dict(max_memory="4GiB"), "sdpa"),
    "ours_full_unchunked": ("lowmem defaults, chunked_loss=False", dict(chunked_loss=False), "sdpa"),
    "ours_fp16": ("lowmem, precision='16-mixed' (loss scaling)", dict(precision="16-mixed"), "sdpa"),
    "ours_fp16_flag": ("lowmem, fp16=True (aitextgen's flag)", dict(fp16=True), "sdpa"),
    "ours_fp32": ("lowmem, fp16=False", dict(fp16=False), "sdpa"),
    "ours_full_ckpt": ("lowmem, gradient_checkpointing=True", dict(gradient_checkpointing=True), "sdpa"),
    "ours_lora_ckpt": ("lowmem, lora=True, gradient_checkpointing=True", dict(lora=True, gradient_checkpointing=True),
                       "sdpa"),
    "ours_full_partial": ("lowmem, max_memory between the plans with and without checkpointing",
                          dict(max_memory=os.environ.get("BENCH_PARTIAL_BUDGET", "6.8GiB")), "sdpa"),
    "ours_accum8": ("lowmem, gradient_accumulation_steps=8", dict(gradient_accumulation_steps=8), "sdpa"),
    "ours_accum8_pinned": ("lowmem, gradient_accumulation_steps=8, pin_micro_batch=True",
                           dict(gradient_accumulation_steps=8, pin_micro_batch=True), "sdpa"),
    "ours_lora_accum8": ("lowmem, lora=True, gradient_accumulation_steps=8",
                         dict(lora=True, gradient_accumulation_steps=8), "sdpa"),
    "ours_accum8_max_8gib": ("lowmem, gradient_accumulation_steps=8, max_memory='8GiB'",
                             dict(gradient_accumulation_steps=8, max_memory="8GiB"), "sdpa"),
    "ours_max_6gib": ("lowmem, max_memory='6GiB' (full fine-tune; issue 20: 774M)", dict(max_memory="6GiB"), "sdpa"),
    "ours_accum8_max_4gib": ("lowmem, gradient_accumulation_steps=8, max_memory='4GiB'",
                             dict(gradient_accumulation_steps=8, max_memory="4GiB"), "sdpa"),
    "ours_full_keep_heap": ("lowmem defaults, full fine-tune, heap not released", dict(), "sdpa"),
    "ours_lora_keep_heap": ("lowmem defaults, lora=True, heap not released", dict(lora=True), "sdpa"),
    "ours_full_no_cpu_speedups": ("lowmem defaults, full fine-tune, no cpu_speed swaps", dict(), "sdpa"),
    "ours_lora_no_cpu_speedups": ("lowmem defaults, lora=True, no cpu_speed swaps", dict(lora=True), "sdpa"),
    # torch.compile (compiling.py) against eager, at batch 1 and at the planner's micro-batch of 8 (GPU rows)
    "ours_compile_blocks": ("lowmem defaults, torch_compile=True (each block)", dict(torch_compile=True), "sdpa"),
    "ours_compile_model": ("lowmem defaults, torch_compile='model'", dict(torch_compile="model"), "sdpa"),
    "ours_accum8_compile_blocks": ("lowmem, gradient_accumulation_steps=8, torch_compile=True",
                                   dict(gradient_accumulation_steps=8, torch_compile=True), "sdpa"),
    "ours_accum8_compile_model": ("lowmem, gradient_accumulation_steps=8, torch_compile='model'",
                                  dict(gradient_accumulation_steps=8, torch_compile="model"), "sdpa"),
    # the defaults over a long run: a save and a validation every 2 steps (LONG_RUN_STEPS steps in all)
    "ours_full_long": ("lowmem defaults, full fine-tune, saving and validating every 2 steps",
                       dict(save_every=2, val_data=0.02, eval_every=2), "sdpa"),
}
LONG_RUN_STEPS = 12
# --references: the aitextgen recipe, our defaults and the Trainer at its best CPU settings, in turn
REFERENCES = ["baseline", "ours_full", "ours_lora", "trainer_full", "trainer_lora", "ours_full_long"]
PEERS = {
    # name: (description, Trainer optim, LoRA), each matched with one of ours; "{precision}": bf16 where the
    # device computes it natively (GPUs, CPUs with AVX512-BF16/AMX), else fp32 (emulated bf16 is slower)
    "trainer_full": ("Trainer: {precision}, gradient_checkpointing, adamw_torch", "adamw_torch", False),
    "trainer_full_8bit": ("Trainer: {precision}, gradient_checkpointing, adamw_torch_8bit", "adamw_torch_8bit", False),
    "trainer_lora": ("Trainer: peft LoRA r=8 on a {precision} base, gradient_checkpointing", "adamw_torch", True),
}
MATCHED = {"trainer_full": "ours_full", "trainer_full_8bit": "ours_full_8bit", "trainer_lora": "ours_lora"}
GPU_ONLY = {"ours_fp16"}
# CPU A/B rows: the plan's field turned off
TURNED_OFF = {"ours_full_keep_heap": "hold_freed_heap", "ours_lora_keep_heap": "hold_freed_heap",
              "ours_full_no_cpu_speedups": "cpu_speedups", "ours_lora_no_cpu_speedups": "cpu_speedups"}


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM), Linux >= 4.0."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


class Probe:
    """Records step times and the training peak; plain-loop and Lightning alike."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.times: list[float] = []
        self.tokens: list[int] = []  # tokens of each recorded micro-batch or step
        self.durations: list[float] = []  # each step from its batch's start to its end (saves left out)
        self.peak = 0

    def start(self) -> None:
        if self.gpu:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()
        self.times.append(time.perf_counter())

    def step(self, tokens: int = 0) -> None:
        """A micro-batch or step of `tokens` tokens ended (0: one sequence of the block)."""
        if self.gpu:
            import torch

            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        self.tokens.append(tokens)

    def finish(self) -> None:
        if self.gpu:
            import torch

            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = vm_hwm_bytes()


def dataset(block: int):
    import pydoc_data.topics

    from lowmem_aitextgen.TokenDataset import TokenDataset

    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return TokenDataset(texts=[text[:200_000]], block_size=block)


def build_model(attention: str, turned_off: str | None = None):
    """The 355M architecture (BENCH_SIZE: another); `turned_off` names a plan field (a CPU technique) the run leaves out."""
    import dataclasses

    from transformers import GPT2Config

    from lowmem_aitextgen import aitextgen

    class WithoutOne(aitextgen):
        def _training_plan(self, args):
            plan, *data = super()._training_plan(args)
            return dataclasses.replace(plan, **{turned_off: False}), *data

    # BENCH_SIZE: another GPT-2 size ("774M", "1558M"); BENCH_N_LAYER: a quicker smoke test of this script
    # (the results are for the size's own layers)
    from lowmem_aitextgen.training.estimate import GPT2_SIZES

    size = dict(GPT2_SIZES[os.environ.get("BENCH_SIZE", "355M")])
    size["n_layer"] = int(os.environ.get("BENCH_N_LAYER", size["n_layer"]))
    config = GPT2Config(**size)
    config._attn_implementation = attention
    return (WithoutOne if turned_off else aitextgen)(config=config)


def run_baseline(ai, data, steps: int, probe: Probe, gpu: bool) -> None:
    """aitextgen 0.6.0's training step, as its ATGTransformer + Trainer ran it."""
    import torch

    device = "cuda" if gpu else "cpu"
    model = ai.model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8, weight_decay=0.05)
    probe.start()
    for i in range(steps):
        batch = data[i].unsqueeze(0).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        probe.step()
    probe.finish()


def run_library(ai, data, steps: int, probe: Probe, kwargs: dict, gpu: bool) -> dict:
    """Our train(); returns the plan it chose and that plan's estimate."""
    import pytorch_lightning as pl

    from lowmem_aitextgen.training.budget import estimate_plan

    chosen = {}

    class LightningProbe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            chosen["plan"] = pl_module.plan
            probe.start()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            chosen["last_loss"] = float(outputs["loss"])
            probe.step(batch.numel())
            probe.durations.append(time.perf_counter() - self.started)

        def on_train_end(self, trainer, pl_module):
            probe.finish()

    # the final save to memory on GPU machines: it is not what is measured, and disks there are slow
    kwargs = {"save_every": 0, **kwargs}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if gpu and os.path.isdir("/dev/shm") else None) as out:
        ai.train(data, output_dir=out, num_steps=steps, learning_rate=1e-4, generate_every=0,
                 n_gpu=1 if gpu else 0, callbacks=[LightningProbe()], progress_bar_refresh_rate=1, **kwargs)
    plan = chosen["plan"]
    described = {"precision": plan.precision, "compiled": plan.torch_compile, "checkpointed_blocks": plan.checkpointed_blocks,
                 "held_heap": plan.hold_freed_heap,
                 "lora": plan.trains_lora, "chunked_loss": bool(plan.loss_chunk_tokens),
                 "optimizer": plan.optimizer, "batch": f"{plan.micro_batch_size}x{plan.accumulation}"}
    return {"last_loss": chosen["last_loss"], "plan": described,
            "estimate_bytes": estimate_plan(ai.model.config, plan, data.block_size).total}


def run_trainer(ai, data, steps: int, probe: Probe, optim: str, lora: bool, gpu: bool) -> None:
    """transformers' Trainer on the same model and data, at its best memory settings."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = ai.model
    bf16 = trainer_bf16(gpu)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model.to(torch.bfloat16 if bf16 else torch.float32), LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["c_attn", "c_proj", "c_fc"],
            fan_in_fan_out=True, task_type="CAUSAL_LM"))

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    class TrainerProbe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.start()

        def on_step_end(self, args, state, control, **kwargs):
            probe.step()

        def on_train_end(self, args, state, control, **kwargs):
            probe.finish()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-4,
            weight_decay=0.05, max_grad_norm=0.5, bf16=bf16, gradient_checkpointing=True, optim=optim,
            save_strategy="no", report_to=[], logging_steps=steps, dataloader_num_workers=0, seed=0,
            use_cpu=not gpu)
        Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[TrainerProbe()]).train()


def trainer_bf16(gpu: bool) -> bool:
    """The Trainer's best precision here: bf16 where it is native, else fp32."""
    from lowmem_aitextgen import hardware

    return hardware.bf16_native("gpu" if gpu else "cpu")


def run_one(name: str, device: str, block: int, steps: int) -> dict:
    import torch

    from lowmem_aitextgen import hardware

    gpu = device == "gpu"
    data = dataset(block)
    probe = Probe(gpu)
    extra: dict = {}
    if name == "ours_full_long":
        steps = LONG_RUN_STEPS
    if name in PEERS:
        description, optim, lora = PEERS[name]
        description = description.format(precision="bf16" if trainer_bf16(gpu) else "fp32")
        run_trainer(build_model("sdpa"), data, steps, probe, optim, lora, gpu)
    else:
        description, kwargs, attention = CONFIGS[name]
        ai = build_model(attention, TURNED_OFF.get(name))
        if kwargs is None:
            run_baseline(ai, data, steps, probe, gpu)
        else:
            extra = run_library(ai, data, steps, probe, kwargs, gpu)
    timed = probe.times[2:]  # the first step is warm-up
    tokens = sum(t or block for t in probe.tokens[2:])  # those ended after timed[0]
    tokens_per_s = tokens / (timed[-1] - timed[0]) if len(timed) > 1 else float("nan")
    return {
        "config": name,
        "description": description,
        "device": torch.cuda.get_device_name() if gpu else str(hardware.cpu()),
        "block": block,
        "steps": steps,
        "peak_train_bytes": probe.peak,
        "peak_process_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tokens_per_s": tokens_per_s,
        **({"step_seconds": probe.durations} if probe.durations else {}),
        **extra,
    }


def merged_rounds(results: list[dict]) -> list[dict]:
    """One row per configuration: the median tokens/s over its rounds and the highest peaks,
    with each round's tokens/s kept (`--rounds`: the configurations run in turn, so a slow
    spell of this shared machine falls on all of them rather than on one)."""
    rows: dict[str, dict] = {}
    for r in results:
        row = rows.setdefault(r["config"], {**r, "rounds_tokens_per_s": []})
        row["rounds_tokens_per_s"].append(r["tokens_per_s"])
        for key in ("peak_train_bytes", "peak_process_bytes"):
            row[key] = max(row[key], r[key])
    for row in rows.values():
        row["tokens_per_s"] = statistics.median(row["rounds_tokens_per_s"])
    return list(rows.values())


def table(results: list[dict]) -> str:
    results = merged_rounds(results)
    base = next((r for r in results if r["config"] == "baseline"), None)
    lines = ["| configuration | peak (train) GiB | vs baseline | estimate GiB | peak (process) GiB | tokens/s "
             "| vs baseline | each round: tokens/s (vs baseline) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem_ratio = r["peak_train_bytes"] / base["peak_train_bytes"] if base else float("nan")
        speed_ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        base_rounds = base["rounds_tokens_per_s"] if base else [float("nan")] * len(r["rounds_tokens_per_s"])
        rounds = ", ".join(f"{t:.1f} ({t / b:.2f}x)" for t, b in zip(r["rounds_tokens_per_s"], base_rounds))
        estimate = f"{r['estimate_bytes'] / 2**30:.2f}" if "estimate_bytes" in r else "–"
        lines.append(
            f"| {r['description']} | {r['peak_train_bytes'] / 2**30:.2f} | {mem_ratio:.2f}x | {estimate} | "
            f"{r['peak_process_bytes'] / 2**30:.2f} | {r['tokens_per_s']:.1f} | {speed_ratio:.2f}x | {rounds} |"
        )
    by_name = {r["config"]: r for r in results}
    pairs = [(peer, ours) for peer, ours in MATCHED.items() if peer in by_name and ours in by_name]
    if pairs:
        lines += ["", "| peer | peak GiB | ours | peak GiB | peer's peak / ours | peer's tokens/s / ours |",
                  "|---|---|---|---|---|---|"]
        for peer, ours in pairs:
            p, o = by_name[peer], by_name[ours]
            lines.append(f"| {p['description']} | {p['peak_train_bytes'] / 2**30:.2f} | {o['description']} | "
                         f"{o['peak_train_bytes'] / 2**30:.2f} | "
                         f"{p['peak_train_bytes'] / o['peak_train_bytes']:.2f}x | "
                         f"{p['tokens_per_s'] / o['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


# ours against each reference, by tokens/s in the same round: (ours, reference, what the issue asks)
REFERENCE_RATIOS = [("ours_full", "baseline"), ("ours_full", "trainer_full"), ("ours_lora", "trainer_lora"),
                    ("ours_lora", "baseline")]


def long_run_drift(row: dict) -> float:
    """The long run's step time over its last 4 steps against its first 4 timed ones (steps 2-5), medians."""
    seconds = row["step_seconds"]
    return statistics.median(seconds[-4:]) / statistics.median(seconds[1:5])


def reference_table(results: list[dict]) -> str:
    """Our defaults' tokens/s over the references', per round (configurations alternate in each round) and
    the median of those ratios; the long run's drift."""
    by_round: dict[int, dict[str, dict]] = {}
    for r in results:
        by_round.setdefault(r.get("round", 0), {})[r["config"]] = r
    lines = ["| ours | reference | ratio (median of rounds) | each round |", "|---|---|---|---|"]
    for ours, reference in REFERENCE_RATIOS:
        ratios = [rows[ours]["tokens_per_s"] / rows[reference]["tokens_per_s"] for rows in by_round.values()
                  if ours in rows and reference in rows]
        if ratios:
            described = {r["config"]: r["description"] for r in results}
            lines.append(f"| {described[ours]} | {described[reference]} | {statistics.median(ratios):.2f}x | "
                         + ", ".join(f"{x:.2f}x" for x in ratios) + " |")
    drifts = [long_run_drift(r) for r in results if r["config"] == "ours_full_long"]
    if drifts:
        lines += ["", "long run (save and validation every 2 steps): step time, last 4 steps / first 4 timed: "
                  + ", ".join(f"{d:.3f}" for d in drifts)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--block", type=int, default=None, help="default: 512 on CPU, 1024 on GPU")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", choices=[*CONFIGS, *PEERS], action="append")
    parser.add_argument("--peers", action="store_true", help="also run transformers' Trainer (needs a GPU: bf16 AMP)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write results as JSON lines here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the configurations in turn this many times; tokens/s is the median")
    parser.add_argument("--references", action="store_true",
                        help="the aitextgen recipe, our defaults (full, LoRA, a long run) and transformers' "
                             "Trainer at its best settings here, in turn; prints our ratios to each")
    args = parser.parse_args()
    block = args.block or (1024 if args.device == "gpu" else 512)

    if args.child:
        print("RESULT " + json.dumps(run_one(args.child, args.device, block, args.steps)), flush=True)
        return
    results = []
    skip = set(TURNED_OFF) if args.device == "gpu" else GPU_ONLY  # the A/B rows turn off CPU-only callbacks
    names = args.only or (REFERENCES if args.references else [n for n in CONFIGS if n not in skip])
    if args.peers and not args.only and not args.references:
        names += list(PEERS)
    for round_, name in ((r, n) for r in range(args.rounds) for n in names):
        command = [sys.executable, __file__, "--child", name, "--device", args.device, "--block", str(block),
                   "--steps", str(args.steps)]
        proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append({**json.loads(lines[-1][len("RESULT "):]), "round": round_})
        print(json.dumps(results[-1]), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(results[-1]) + "\n")
    print(table(results))
    print(reference_table(results))


if __name__ == "__main__":
    main()
