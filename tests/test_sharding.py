"""strategy="fsdp" (FSDP2 through Lightning's ModelParallelStrategy) on two CPU processes over gloo, through
the ai.train() users call; the per-process estimate; and the offload tier, planned on presented cards."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from conftest import snapshot, tiny_gpt2_config
from lowmem_aitextgen import aitextgen, cards, estimate_memory, hardware
from lowmem_aitextgen.training import oom

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def train(corpus_file, tokenizer_file, base_folder, output_dir, record, strategy, lora=False, num_steps=4,
          stop_at=0, resume=False, precision="32-true", val_data=0.0, env=None) -> list[float]:
    """sharded_train.py in two processes; rank 0's loss at each micro-batch."""
    os.makedirs(record, exist_ok=True)
    result = run_script(corpus_file, tokenizer_file, base_folder, output_dir, record, strategy, lora, num_steps, stop_at,
                        resume, precision, val_data, env)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(record, "losses.json"), encoding="utf-8") as f:
        return json.load(f)


def run_script(corpus_file, tokenizer_file, base_folder, output_dir, record, strategy, lora, num_steps, stop_at,
               resume, precision, val_data, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "sharded_train.py"), corpus_file, tokenizer_file, base_folder,
         output_dir, record, strategy, str(int(lora)), str(num_steps), str(stop_at), str(int(resume)), precision,
         str(val_data)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


ROUNDED_UP = 1e-3  # the share of a weight's elements whose gradient is near zero (see assert_same_weights)


def assert_same_weights(sharded: dict, replicated: dict, learning_rate: float = 1e-2, steps: int = 6) -> None:
    """FSDP's saved weights against DDP's: within float rounding (the reduce-scatter sums in another order),
    but where a gradient is zero or near it.  AdamW's step, m / (sqrt(v) + eps), scales a near-zero gradient's
    rounding noise up to steps of about the learning rate, in either direction: there the runs agree only within
    learning_rate x steps.  So it is for the attention's key bias (its gradient is zero but for rounding: softmax
    ignores what adds the same to every score of a query), and for a few elements of other weights (an Intel Xeon
    with AMX: 1-2 of 12,288-64,000, up to 2.8e-5 apart); at most ROUNDED_UP of any weight."""
    assert sharded.keys() == replicated.keys()
    for key, value in replicated.items():
        mine = sharded[key].clone()
        if key.endswith("attn.c_attn.bias"):
            width = value.numel() // 3
            keys = slice(width, 2 * width)
            assert (mine[keys] - value[keys]).abs().max() <= learning_rate * steps, key
            mine[keys] = value[keys]
        apart = ~torch.isclose(mine, value, rtol=1e-4, atol=1e-5)
        assert int(apart.sum()) <= max(1, int(ROUNDED_UP * value.numel())), (key, int(apart.sum()), value.numel())
        assert float((mine - value).abs().max()) <= learning_rate * steps, key


def max_memory_for(base_folder: str, gathered_for: str, precision: str) -> int:
    """A max_memory under which sharded_train.py's fsdp plan can gather no more than `gathered_for` says:
    what that plan needs (with glibc's heap held, its least), by the planner's own estimate."""
    from lowmem_aitextgen.training.budget import budgeted_bytes
    from lowmem_aitextgen.training.estimate import estimate_plan

    model = AutoModelForCausalLM.from_pretrained(base_folder)
    plan = cards.plan_of_call(model, n_gpu=0, devices=2, strategy="fsdp", batch_size=2, gradient_accumulation_steps=2,
                              pin_micro_batch=True, gradient_checkpointing=True, precision=precision)
    plan = dataclasses.replace(plan, gathered_for=gathered_for, hold_freed_heap=True)
    return budgeted_bytes(plan, estimate_plan(model.config, plan, model.config.n_positions))


@pytest.mark.edges
@pytest.mark.parametrize("lora, gathered_for", [(False, "step"), (False, "block"), (True, "step")])
def test_fsdp_trains_as_ddp_does_and_saves_a_folder_one_process_loads(corpus_file, tokenizer_file, base_folder,
                                                                       lora, gathered_for):
    # bf16 under LoRA: its frozen base is held in 16 bits beside fp32 adapters, both in one FSDP unit
    precision = "bf16-mixed" if lora else "32-true"
    # "step" is the fastest plan where memory is plenty; "block" the least memory, below "micro-batch" only
    # from 3 blocks up (two are whole at a time)
    budget = {}
    if gathered_for == "block":
        base_folder = os.path.abspath("base4")
        GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)).save_pretrained(base_folder)
        budget = {"MAX_MEMORY": str(max_memory_for(base_folder, gathered_for, precision))}
    ddp = train(corpus_file, tokenizer_file, base_folder, "ddp", "ddp_record", "ddp", lora, precision=precision)
    fsdp = train(corpus_file, tokenizer_file, base_folder, "fsdp", "fsdp_record", "fsdp", lora, precision=precision,
                 env=budget)
    with open("fsdp/training_summary.json", encoding="utf-8") as f:
        plan = json.load(f)["plan"]
    assert plan["shards"] == 2 and plan["offload"] is False and plan["gathered_for"] == gathered_for
    assert len(fsdp) == len(ddp) == 8  # a loss a micro-batch: 4 steps of 2
    torch.testing.assert_close(fsdp, ddp, rtol=1e-5, atol=1e-5)
    assert fsdp[-1] < fsdp[0]

    assert sorted(os.listdir("fsdp")) == sorted(os.listdir("ddp"))  # the same folder as a DDP run's
    sharded = load_file("fsdp/model.safetensors")
    assert_same_weights(sharded, load_file("ddp/model.safetensors"), steps=4)
    start = load_file(os.path.join(base_folder, "model.safetensors"))
    assert not torch.equal(sharded["transformer.h.0.mlp.c_fc.weight"], start["transformer.h.0.mlp.c_fc.weight"])
    if lora:
        adapter = load_file("fsdp/lora_adapter/adapter_model.safetensors")
        assert adapter.keys() == load_file("ddp/lora_adapter/adapter_model.safetensors").keys()

    ai = aitextgen(model_folder="fsdp", tokenizer_file=tokenizer_file)  # one process, no process group
    assert ai.generate_one(prompt="The", max_length=16, seed=1)


@pytest.mark.edges
def test_fsdp_resumes_to_the_uninterrupted_weights(corpus_file, tokenizer_file, base_folder):
    uninterrupted = train(corpus_file, tokenizer_file, base_folder, "whole", "r1", "fsdp", num_steps=6)
    first = train(corpus_file, tokenizer_file, base_folder, "parts", "r2", "fsdp", num_steps=6, stop_at=3)
    checkpoint = torch.load("parts/last.ckpt", weights_only=True, mmap=True)
    assert checkpoint["global_step"] == 3  # one file, gathered on rank 0: resumable in any number of processes
    rest = train(corpus_file, tokenizer_file, base_folder, "parts", "r3", "fsdp", num_steps=6, resume=True)
    assert first + rest == uninterrupted
    whole, parts = load_file("whole/model.safetensors"), load_file("parts/model.safetensors")
    for key, value in whole.items():
        assert torch.equal(parts[key], value), key
    assert not os.path.exists("parts/last.ckpt")


def test_fsdp_validation_is_reduced_across_ranks_and_keeps_the_best_model(corpus_file, tokenizer_file, base_folder):
    train(corpus_file, tokenizer_file, base_folder, "ddp", "ddp_record", "ddp", num_steps=6, val_data=0.25)
    train(corpus_file, tokenizer_file, base_folder, "fsdp", "fsdp_record", "fsdp", num_steps=6, val_data=0.25)
    summaries = {}
    for name in ("ddp", "fsdp"):
        with open(f"{name}/training_summary.json", encoding="utf-8") as f:
            summaries[name] = json.load(f)
    evaluations = [[(e["step"], e["loss"]) for e in summaries[name]["validation"]] for name in ("ddp", "fsdp")]
    assert [step for step, _ in evaluations[1]] == [2, 4, 6]
    torch.testing.assert_close([loss for _, loss in evaluations[1]], [loss for _, loss in evaluations[0]],
                               rtol=1e-5, atol=1e-5)
    assert summaries["fsdp"]["best_step"] == summaries["ddp"]["best_step"]
    # the best model, gathered from the shards when it was the best
    assert_same_weights(load_file("fsdp/model.safetensors"), load_file("ddp/model.safetensors"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_processes_that_planned_differently_stop_together_naming_the_difference(corpus_file, tokenizer_file,
                                                                                base_folder, finished, strategy):
    # a machine's processes each fit the plan to their own device: here rank 1 is shown a CPU without
    # native bf16, so that precision left to the device is bf16-mixed on rank 0 and fp32 on rank 1
    before = snapshot(finished)
    result = run_script(corpus_file, tokenizer_file, base_folder, finished, "record", strategy, False, 4, 0, False,
                        "device", 0.0, env={"PRESENT_CPUS": "native bf16,no native bf16"})
    assert result.returncode != 0
    assert ("The training processes planned differently, each for its own device: process 0 decided "
            "precision=bf16-mixed") in result.stderr
    assert "process 1 decided precision=32-true" in result.stderr
    assert snapshot(finished) == before  # stopped before any step, and before any save


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="fsdp", optimizer="adamw8bit"), "optimizer='adamw8bit' cannot be used with strategy='fsdp'"),
    (dict(strategy="fsdp_cpu_offload"), "on a CPU they are there already"),
])
def test_sharding_choices_that_cannot_work_are_refused_before_any_work(finished, corpus_file, kwargs, message):
    before = snapshot(finished)
    with pytest.raises(ValueError, match=message):
        aitextgen(model_folder=finished).train(corpus_file, output_dir=finished, n_gpu=0, **kwargs)
    assert snapshot(finished) == before


def test_fsdp_in_one_process_trains_as_one_process(finished, corpus_file, caplog):
    ai = aitextgen(model_folder=finished)
    ai.train(corpus_file, output_dir=finished, n_gpu=0, strategy="fsdp", num_steps=2, save_every=0,
             generate_every=0)
    with open(os.path.join(finished, "training_summary.json"), encoding="utf-8") as f:
        assert json.load(f)["plan"]["shards"] == 1
    assert "nothing to shard the model across" in caplog.text


def test_the_estimate_is_one_process_share_of_a_sharded_model():
    whole = estimate_memory("355M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True)
    halves = estimate_memory("355M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True, shards=2)
    quarters = estimate_memory("355M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True,
                               shards=4)
    for part in ("weights", "gradients", "optimizer_states"):
        assert getattr(halves, part) == -(-getattr(whole, part) // 2)
        assert getattr(quarters, part) == -(-getattr(whole, part) // 4)
    assert halves.activations == whole.activations  # each process still trains its own micro-batch
    # the embeddings and head and two blocks are gathered whole while they compute: 355M's are 0.3+ GiB
    gathered = halves.overhead - whole.overhead
    assert 0.3 * 2**30 < gathered == quarters.overhead - whole.overhead
    assert quarters.total < halves.total < whole.total


def test_the_estimate_of_an_offloaded_model_counts_the_host_and_the_card_apart():
    on_card = estimate_memory("1558M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True,
                              device="cuda")
    offloaded = estimate_memory("1558M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True,
                                device="cuda", offload=True)
    # the host holds what the card no longer does: fp32 weights, their gradients and AdamW's two states
    assert offloaded.host == on_card.weights + on_card.gradients + on_card.optimizer_states
    assert offloaded.weights == offloaded.gradients == offloaded.optimizer_states == 0
    assert offloaded.activations == on_card.activations
    assert offloaded.total < 8 * 2**30 < on_card.total
    assert "host memory" in str(offloaded)
    halves = estimate_memory("1558M", block_size=1024, precision="bf16-mixed", gradient_checkpointing=True,
                             device="cuda", offload=True, shards=2)
    assert halves.host == -(-on_card.weights // 2) - (-on_card.gradients // 2) - (-on_card.optimizer_states // 2)
    with pytest.raises(ValueError, match="offload=True keeps the weights in host memory while a GPU computes"):
        estimate_memory("124M", offload=True)
    with pytest.raises(ValueError, match="optimizer='adamw8bit' cannot train a sharded or offloaded model"):
        estimate_memory("124M", shards=2, optimizer="adamw8bit")


BIG_HOST = dataclasses.replace(hardware.CPUS["native bf16"], name="CPU with 100 GiB", available=100 * 2**30)


def plan_on(size: str, card: str | hardware.GPU | None, host: hardware.CPU, lora: bool = False, **call):
    """train(**call)'s plan for GPT-2 `size` on the named (or given) card with `host` beside it (or the
    MemoryError)."""
    hardware.CPUS["test host"] = host
    if isinstance(card, hardware.GPU):
        hardware.SHARED_CARDS["test card"], card = card, "test card"
    try:
        return cards.planned.__wrapped__(size, card, lora, "test host", **call)
    finally:
        del hardware.CPUS["test host"]
        hardware.SHARED_CARDS.pop("test card", None)


def test_the_offload_tier_is_chosen_only_where_nothing_on_the_card_fits():
    plan, estimate = plan_on("1558M", "80 GiB, 8 GiB free", BIG_HOST)
    assert plan.offload and plan.optimizer == "adamw" and plan.strategy == "fsdp"
    assert estimate.total <= plan.budget.bytes  # the card's side
    params = 1_557_611_200
    # fp32 weights, gradients and AdamW's two states (and its step counters), all in host memory
    assert params * 16 <= estimate.host < params * 16 + 2**20
    assert estimate.weights == estimate.gradients == estimate.optimizer_states == 0
    assert estimate.host <= plan.budget.host_bytes
    assert "of host memory" in plan.chosen_because and "AdamW runs on the CPU" in plan.chosen_because
    assert "offload=" in plan.describe(params, params, 0)

    on_card, _ = plan_on("355M", "8 GiB", BIG_HOST)  # fits on the card: never offloaded
    assert not on_card.offload and on_card.strategy == "auto"
    with_lora, _ = plan_on("1558M", "80 GiB, 8 GiB free", BIG_HOST, lora=True)
    assert not with_lora.offload


def test_the_offload_tier_needs_the_host_memory_and_a_gpu():
    small = dataclasses.replace(BIG_HOST, available=16 * 2**30)
    refused = plan_on("1558M", "80 GiB, 8 GiB free", small)
    assert isinstance(refused, MemoryError)
    assert "would fit the card, but needs 23.21 GiB of host memory" in str(refused)
    for cpu in hardware.CPUS:  # on CPU alone, never: the weights are in host memory already
        result = cards.planned("1558M", None, False, cpu)
        assert isinstance(result, MemoryError) or not result[0].offload
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cards.model_config("124M"))
    with hardware.presenting(cards.hardware_named("8 GiB")):
        asked = cards.plan_of_call(model, strategy="fsdp_cpu_offload")  # Lightning's name for it
    assert asked.offload and asked.strategy == "fsdp" and asked.shards == 1


def test_the_processes_of_one_machine_share_its_memory():
    host = dataclasses.replace(BIG_HOST, available=20 * 2**30, resident=2**30)
    alone, _ = plan_on("124M", None, host, n_gpu=0)
    pair, estimate = plan_on("124M", None, host, n_gpu=0, strategy="fsdp", devices=2)
    assert alone.budget.processes == 1 and pair.budget.processes == 2
    assert pair.budget.bytes == alone.budget.bytes // 2  # each CPU process plans for half of the machine
    assert "shared by 2 processes" in str(pair.budget)

    # two cards with 8 GiB free each, sharded and offloaded: each process holds half of the 23.2 GiB of
    # fp32 weights, gradients and AdamW states in host memory, which both processes share
    pair_of_cards = dataclasses.replace(hardware.SHARED_CARDS["80 GiB, 8 GiB free"], count=2)
    roomy, estimate = plan_on("1558M", pair_of_cards, dataclasses.replace(host, available=30 * 2**30),
                              strategy="fsdp")
    assert roomy.offload and roomy.shards == 2 and roomy.budget.processes == 2
    assert estimate.host <= roomy.budget.host_bytes < 15 * 2**30  # its half of the host
    # 20 GiB would hold one process's half (11.6 GiB), but not both halves
    refused = plan_on("1558M", pair_of_cards, host, strategy="fsdp")
    assert isinstance(refused, MemoryError)
    assert "in each of the 2 processes this machine runs" in str(refused)


@pytest.mark.parametrize("defer", [True, False])
def test_a_deferred_reduction_holds_a_steps_gradients_whole_until_its_last_micro_batch(defer):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lowmem_aitextgen.training import sharding
    from lowmem_aitextgen.training.plan import TrainPlan

    reference = GPT2LMHeadModel(tiny_gpt2_config())
    model = GPT2LMHeadModel(tiny_gpt2_config())
    model.load_state_dict(reference.state_dict())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharding.shard(model, init_device_mesh("cpu", (1,)), TrainPlan(shards=2, gathered_for="step"))
        strategy = sharding.ShardingStrategy(data_parallel_size=1, tensor_parallel_size=1, defer_reduction=defer)
        strategy._lightning_module = types.SimpleNamespace(model=model)
        batches = torch.randint(0, 1000, (2, 2, 16))
        with strategy.block_backward_sync():  # what Lightning runs a step's micro-batches but the last in
            model(batches[0], labels=batches[0]).loss.backward()
        # deferred: the weights stay gathered whole with their whole, unreduced gradients; else each process
        # is back to its shards, the first micro-batch's gradients reduced into them
        whole = [not isinstance(p, DTensor) and isinstance(p.grad, torch.Tensor) for p in model.parameters()]
        assert all(whole) if defer else not any(whole)
        model(batches[1], labels=batches[1]).loss.backward()
        sharded = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    for batch in batches:
        reference(batch, labels=batch).loss.backward()
    for name, parameter in reference.named_parameters():  # both micro-batches' gradients, summed
        torch.testing.assert_close(sharded[name], parameter.grad, rtol=1e-5, atol=1e-6)


def test_a_sharded_process_holds_gathered_weights_only_where_its_memory_allows():
    from lowmem_aitextgen.training.budget import budgeted_bytes
    from lowmem_aitextgen.training.estimate import estimate_plan

    call = dict(n_gpu=0, devices=2, strategy="fsdp", batch_size=1, gradient_accumulation_steps=4, pin_micro_batch=True,
                gradient_checkpointing=True, precision="32-true")
    fastest, estimate = plan_on("355M", None, BIG_HOST, **call)
    assert fastest.gathered_for == "step"  # collectives once a step: the fastest, with memory to spare
    assert "gathered whole for a step" in fastest.describe(1, 1, 0)
    # the same plan holding a block at a time needs over 2 GiB less: "step" holds every weight and gradient whole
    least = dataclasses.replace(fastest, gathered_for="block", hold_freed_heap=True)
    needs = budgeted_bytes(least, estimate_plan(cards.model_config("355M"), least, 1024))
    assert budgeted_bytes(fastest, estimate) > needs + 2 * 2**30
    lean, _ = plan_on("355M", None, BIG_HOST, max_memory=needs, **call)
    assert lean.gathered_for == "block"
    # out of memory, the first thing given up is what a process holds gathered
    assert oom.cheaper_plan(fastest)[0] == "each block's weights gathered only while it computes"


def endings_script(corpus_file, tokenizer_file, base, output_dir, next_dir, record, ending) -> None:
    os.makedirs(record, exist_ok=True)
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "sharded_endings.py"), corpus_file, tokenizer_file,
                             base, output_dir, next_dir, record, ending], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def assert_holds(record: str, name: str, other: aitextgen) -> None:
    """What sharded_endings.py recorded of its object equals `other`'s model: weights, dtype, a seed's text."""
    mine, theirs = load_file(os.path.join(record, f"{name}.safetensors")), other.model.state_dict()
    assert mine.keys() == theirs.keys() and all(
        value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]) for key, value in mine.items()), name
    with open(os.path.join(record, f"{name}.json"), encoding="utf-8") as f:
        assert json.load(f)["text"] == other.generate_one(max_length=8, seed=3), name


@pytest.mark.parametrize("ending", ["finished", "Ctrl-C", "weights went bad after a save",
                                    "weights went bad before any save"])
def test_after_a_sharded_run_the_object_holds_what_a_new_object_loads_and_trains_on_as_it_does(
        ending, corpus_file, tokenizer_file, realistic_base, tmp_path):
    """Issue 46's matrix (test_aitextgen.py) for the sharded kind of run: after the ending, rank 0's object holds
    what aitextgen(model_folder=...) loads from the folder holding its model (output_dir, or where the run
    started when nothing good was saved), ai.save() writes it, and training it again (both ranks, into another
    folder) ends as training the new object does."""
    out, record = str(tmp_path / "out"), str(tmp_path / "record")
    endings_script(corpus_file, tokenizer_file, realistic_base, out, str(tmp_path / "next"), record, ending)
    holding = realistic_base if ending == "weights went bad before any save" else out
    for folder in (holding, os.path.join(record, "saved")):
        assert_holds(record, "object", aitextgen(model_folder=folder, tokenizer_file=tokenizer_file))
    reference = str(tmp_path / "reference")
    endings_script(corpus_file, tokenizer_file, holding, "unused", str(tmp_path / "next new"), reference, "none")
    assert_holds(record, "next", aitextgen(model_folder=str(tmp_path / "next new"), tokenizer_file=tokenizer_file))
    assert_holds(reference, "next", aitextgen(model_folder=str(tmp_path / "next"), tokenizer_file=tokenizer_file))
