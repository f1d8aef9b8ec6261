"""Resume after Ctrl-C and after SIGKILL, and real two-process DDP."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import CtrlC, SigTerm
from lowmem_aitextgen import aitextgen

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


@pytest.mark.edges
@pytest.mark.parametrize("lora, optimizer", [(False, "adamw"), (True, "adamw"), (False, "adamw8bit")])
def test_ctrl_c_then_resume_ends_with_the_uninterrupted_weights(small_data, base_folder, tokenizer_file,
                                                                 lora, optimizer):
    def run(output_dir, **kwargs):
        ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
        ai.train(small_data, output_dir=output_dir, num_steps=10, batch_size=2, gradient_accumulation_steps=2,
                 learning_rate=1e-2, warmup_steps=2, save_every=0, generate_every=0, seed=1, lora=lora,
                 optimizer=optimizer, **kwargs)
        return ai

    uninterrupted = run("uninterrupted").model.state_dict()

    stopped = run("interrupted", callbacks=[CtrlC(at_step=4)])  # returns instead of raising
    with open("interrupted/training_summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 5 and "interrupted (Ctrl-C)" in summary["stopped_because"]
    reloaded = aitextgen(model_folder="interrupted", tokenizer_file=tokenizer_file)
    for key, value in stopped.model.state_dict().items():  # LoRA: the object's bf16 merge is the file's rounded
        assert torch.equal(reloaded.model.state_dict()[key].to(value.dtype), value), key
    checkpoint = torch.load("interrupted/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5
    n_trainable = sum(p.numel() for p in checkpoint["state_dict"].values())
    assert (n_trainable < 0.1 * sum(v.numel() for v in uninterrupted.values())) == lora  # adapters only

    resumed = run("interrupted", resume=True).model.state_dict()
    assert uninterrupted.keys() == resumed.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
    assert not torch.equal(resumed["transformer.h.0.mlp.c_fc.weight"],
                           stopped.model.state_dict()["transformer.h.0.mlp.c_fc.weight"])


def test_sigkill_at_any_moment_leaves_a_loadable_model_and_checkpoint(small_data, base_folder, tokenizer_file):
    """Kill a training run that saves every step, at random moments (most of its time is spent saving),
    then check the model loads and the checkpoint resumes."""
    out = "killed"
    rng = random.Random(0)
    steps = []
    for _ in range(4):
        child = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "train_until_killed.py"), small_data,
                                  tokenizer_file, base_folder, out],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        first_save = time.monotonic() + 120
        checkpoint = os.path.join(out, "last.ckpt")
        previous = os.stat(checkpoint).st_mtime_ns if os.path.exists(checkpoint) else None
        while not (os.path.exists(checkpoint) and os.stat(checkpoint).st_mtime_ns != previous):
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < first_save, "the child never saved"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.2, 1.5))
        child.send_signal(signal.SIGKILL)
        child.wait()

        ai = aitextgen(model_folder=out)
        assert all(torch.isfinite(p).all() for p in ai.model.parameters())
        steps.append(torch.load(checkpoint, weights_only=True)["global_step"])
    assert steps == sorted(steps) and steps[-1] > steps[0]  # each run continued the previous one

    ai = aitextgen(model_folder=base_folder, tokenizer_file=tokenizer_file)
    ai.train(small_data, output_dir=out, num_steps=steps[-1] + 1, generate_every=0, resume=True)
    with open(os.path.join(out, "training_summary.json"), encoding="utf-8") as f:
        assert json.load(f)["steps"] == steps[-1] + 1
    assert not os.path.exists(checkpoint)  # a finished run leaves no checkpoint to resume by mistake
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # no half-written leftovers


@pytest.mark.edges
@pytest.mark.parametrize("lora", [False, True])
def test_ddp_on_two_cpu_processes(corpus_file, base_folder, tokenizer_file, tmp_path, lora):
    """With checkpointing, accumulation, the default precision, and LoRA or a full fine-tune."""
    record = tmp_path / "record"
    record.mkdir()
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "ddp_train.py"), corpus_file, tokenizer_file,
                             base_folder, "ddp_out", str(record), str(int(lora))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    seen = [{tuple(block) for block in json.loads((record / f"seen{rank}.json").read_text())} for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 4 * 2 * 2  # steps x accumulation x micro-batch, on each rank
    assert not seen[0] & seen[1]  # each rank trained on its own share of the data

    rank0, rank1 = (torch.load(record / f"final{rank}.pt", weights_only=True) for rank in (0, 1))
    saved = aitextgen(model_folder="ddp_out").model.state_dict()
    for key, value in rank0.items():
        assert torch.equal(rank1[key], value), key  # gradients were averaged across ranks
        assert torch.equal(saved[key].to(value.dtype), value), key  # LoRA: the object holds the bf16 merge
    assert result.stdout.count("steps reached: generating sample texts") == 1  # rank 0 only, at step 2


KINDS = {"lora": {"lora": True}, "ia3": {"peft_config": "ia3"}, "lora on a 4-bit base": {"lora": True, "base_bits": 4},
         "full": {"lora": False}}


@pytest.mark.parametrize("ending", ["Ctrl-C", "SIGTERM"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_readme_resume_line_on_the_same_object_ends_as_an_uninterrupted_run(
        kind, ending, small_data, realistic_base, tokenizer_file):
    """README's "an interrupted run, continued" on the object the interrupted run leaves (which holds the model
    with the adapter merged in): the base is read back and checked, and the run ends bit-equal to one that was
    never interrupted, for every kind of run and ending; a new object on the interrupted run's output_dir is
    refused (its model has the adapter merged in), and the object keeps its model."""
    from peft import IA3Config

    kwargs = {"peft_config": IA3Config()} if kind == "ia3" else KINDS[kind]

    def train(ai, output_dir, **more):  # the README's call: fewer steps, a seed, no samples, a rate that moves
        ai.train(small_data, output_dir=output_dir, num_steps=6, batch_size=1, gradient_accumulation_steps=8,
                 learning_rate=1e-2, max_memory="6GiB", val_data=0.1, save_every=0, generate_every=0, seed=1,
                 **{**kwargs, **more})
        return ai

    uninterrupted = train(aitextgen(model_folder=realistic_base, tokenizer_file=tokenizer_file), "whole")
    ai = aitextgen(model_folder=realistic_base, tokenizer_file=tokenizer_file)
    if ending == "Ctrl-C":
        train(ai, "out", callbacks=[CtrlC(at_step=2)])
    else:
        with pytest.raises(SystemExit):
            train(ai, "out", callbacks=[SigTerm(at_step=2)])
    stopped = {k: v.clone() for k, v in ai.model.state_dict().items()}
    if kind != "full":
        with pytest.raises(ValueError, match="other base weights"):
            train(aitextgen(model_folder="out", tokenizer_file=tokenizer_file), "out", resume=True)
    train(ai, "out", resume=True)
    for key, value in uninterrupted.model.state_dict().items():
        assert torch.equal(ai.model.state_dict()[key], value), key
    assert any(not torch.equal(stopped[key], value) for key, value in ai.model.state_dict().items())


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.edges
def test_two_nodes_started_by_torchrun_train_one_model(corpus_file, base_folder, tokenizer_file, tmp_path):
    """Several machines, as docs/scaling.md describes them, on this one: two "nodes" started by torchrun
    (--nnodes=2 --nproc_per_node=1, a rendezvous on localhost) train with num_nodes=2 on CPU over gloo; the
    ranks see different data, their losses are averaged and their weights end equal, only rank 0 writes
    output_dir, and the folder loads in one process."""
    record = tmp_path / "record"
    record.mkdir()
    port = str(free_port())
    script = os.path.join(SCRIPTS, "two_nodes_train.py")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", script,
                               corpus_file, tokenizer_file, base_folder, str(tmp_path / f"out{node}"), str(record)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        results = [node.communicate(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]

    ranks = [json.loads((record / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["node_rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    seen = [{tuple(block) for block in r["seen"]} for r in ranks]
    assert len(seen[0]) == len(seen[1]) == 4 * 2 and not seen[0] & seen[1]  # each rank its own share
    for (mine0, mean0), (mine1, mean1) in zip(ranks[0]["losses"], ranks[1]["losses"]):
        assert mean0 == mean1 == pytest.approx((mine0 + mine1) / 2)  # one loss: the two ranks' averaged
    final = [torch.load(record / f"final{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert all(torch.equal(final[1][key], value) for key, value in final[0].items())  # gradients averaged
    assert os.path.isfile(tmp_path / "out0" / "model.safetensors") and not os.path.exists(tmp_path / "out1")
    saved = aitextgen(model_folder=str(tmp_path / "out0"), tokenizer_file=tokenizer_file).model.state_dict()
    assert all(torch.equal(saved[key].to(value.dtype), value) for key, value in final[0].items())
