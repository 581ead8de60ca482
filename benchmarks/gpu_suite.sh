#!/usr/bin/env bash
# Build, test and benchmark on a CUDA machine in one go; logs and JSON land in $1 (default ./gpu-results).
#   bash benchmarks/gpu_suite.sh [OUTDIR] [STAGES]
# STAGES: comma list of build,tests,verify,adamw,step,placement,timeline,paging,large,sanitize,
#         clipping,clipping_planned,planned_timeline,spec_timeline,compile,hf,hf_cap,host_adds,streaming,stream_limit,stream_price,light,contention,distributed
#         (default: build,tests,verify,adamw,step)
set -uo pipefail
out="${1:-gpu-results}"
stages=",${2:-build,tests,verify,adamw,step},"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
has() { [[ "$stages" == *",$1,"* ]]; }

{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  nproc; grep -E "MemTotal|MemAvailable|model name" /proc/meminfo /proc/cpuinfo | sort -u | head -4
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } 2>&1 | tee "$out/machine.txt"

if has build; then
  (cd "$repo" && CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DTRAINSTREAM_WITH_CUDA=ON" \
    python3 -m pip install --no-build-isolation --no-deps -q . ) 2>&1 | tail -5 | tee "$out/build.log" || exit 1
  cmake -S "$repo" -B /tmp/ts-build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /tmp/ts-build -j >/dev/null \
    && (cd /tmp/ts-build && ctest 2>&1 | tail -3) | tee -a "$out/build.log"
fi
if has tests; then  # the GPU's own tests (CI runs the rest on every change)
  (cd /tmp && python3 -m pytest "$repo/tests" -q -ra -m gpu --durations=25 2>&1) | tee "$out/pytest.log" | tail -50
fi
if has verify; then
  python3 "$repo/examples/verify_ram_offload.py" 2>&1 | tee "$out/verify.log" | tail -22
  (cd /tmp && python3 -m trainstream demo 2>&1) | tee "$out/demo.log" | tail -25  # README's first command, on the GPU
fi
if has adamw; then
  python3 "$repo/benchmarks/adamw_vs_torch.py" --params 268435456 --json 2>&1 | tee "$out/adamw_vs_torch.log" | tail -15
  [ -x /tmp/ts-build/benchmarks/bench_host_adamw ] && /tmp/ts-build/benchmarks/bench_host_adamw --params 268435456 --threads 4,8,16 \
    --json "$out/bench_host_adamw.json" 2>&1 | tail -20 | tee "$out/bench_host_adamw.log"
fi
if has step; then
  for acc in 1 8 32; do
    steps=$(( acc == 1 ? 30 : acc == 8 ? 12 : 8 ))  # long enough that the final drain hardly counts
    # with TrainStream's baselines: fp32 gradient transfer at acc 1, every forward gated above
    ours=$([ "$acc" -gt 1 ] && echo trainstream,trainstream+vramacc,trainstream+vramacc+everygate \
      || echo trainstream,trainstream+fp32grads)
    modes=gpu-adamw,trainstream,${ours//trainstream/trainstream+offload},torchao,deepspeed  # peers if installed
    python3 "$repo/benchmarks/train_step.py" --acc "$acc" --steps "$steps" --modes "$modes" \
      --json "$out/step_acc$acc.json" 2>&1 | tail -10
  done
fi
if has clipping; then  # clipped offloaded updates: speculated (norm under the threshold), clipping every step,
  # waiting; the no-clip and never-clipping modes twice, since one process's runs of a mode spread
  python3 "$repo/benchmarks/train_step.py" --acc 1 --steps 20 --clip 1.0 --modes \
gpu-adamw+noclip,gpu-adamw,trainstream+offload+noclip,trainstream+offload+clip1e9,trainstream+offload+clip1e9+waitclip,\
trainstream+offload,trainstream+offload+waitclip,trainstream,trainstream+offload+noclip,trainstream+offload+clip1e9 \
    --json "$out/clipping.json" 2>&1 | grep -A14 "^NVIDIA"
fi
if has clipping_planned; then  # the same under a 16 GB cap with no option but the norm: the planner's
  # offloaded parameters speculate (never clipping) or not (no clipping), each twice; then clipping every step
  python3 "$repo/benchmarks/train_step.py" --acc 1 --steps 15 --clip 1.0 --vram-cap-gb 16 --modes \
trainstream+noclip,trainstream+clip1e9,trainstream+noclip,trainstream+clip1e9,trainstream \
    --json "$out/clipping_planned_16gb.json" 2>&1 | grep -A14 "^NVIDIA"
fi
if has planned_timeline; then  # no clipping and a norm that never clips, part by part, planned within the budget a 16 GB cap gives
  for clip in none 1e9; do
    python3 "$repo/benchmarks/step_timeline.py" --mode trainstream+planned --vram-budget 15.46GB --warmup 5 --steps 4 \
      $([ "$clip" = none ] || echo --clip "$clip") --json "$out/timeline_planned_clip_$clip.json" 2>&1 | tail -16
  done
fi
if has spec_timeline; then  # where an offloaded step's time goes without clipping and with a norm that never clips
  for clip in none 1e9; do
    python3 "$repo/benchmarks/step_timeline.py" --mode trainstream --steps 10 $([ "$clip" = none ] || echo --clip "$clip") \
      --json "$out/timeline_clip_$clip.json" 2>&1 | tail -16
  done
fi
if has compile; then  # torch.compile before and after wrap() at accumulation 8, against compiled stock AdamW
  python3 "$repo/benchmarks/train_step.py" --acc 8 --steps 6 --warmup 3 --clip 1.0 --modes \
gpu-adamw,trainstream,trainstream+vramacc,gpu-adamw+compile,trainstream+compile,trainstream+compileafter,\
trainstream+vramacc+compile --json "$out/compile_acc8.json" 2>&1 | grep -A12 "^NVIDIA"
fi
if has hf; then  # the Hugging Face Trainer with its defaults (max_grad_norm=1.0, bf16=True), stock against ours
  python3 "$repo/benchmarks/hf_trainer.py" --accs 1,8 --compile off,on --json "$out/hf_trainer.json" 2>&1 | grep -A12 "^NVIDIA"
fi
if has hf_cap; then  # under a 16 GB cap: the raw loop and TrainStreamTrainer, each accumulation in a process of its own
  for acc in 1 8; do
    python3 "$repo/benchmarks/train_step.py" --clip 1.0 --vram-cap-gb 16 --vram-budget 15GB --acc "$acc" --steps 6 \
      --warmup 4 --modes trainstream --json "$out/raw_cap16_acc$acc.json" 2>&1 | tail -4
    python3 "$repo/benchmarks/hf_trainer.py" --accs "$acc" --compile off --trainers trainstream --vram-cap-gb 16 \
      --vram-budget 15GB --json "$out/hf_trainer_cap16_acc$acc.json" 2>&1 | tail -6
  done
fi
if has host_adds; then  # the Qwen2.5-7B shape under 24 GB at accumulation 8: the threads' adds, measured and planned
  (while sleep 2; do free -m | awk 'NR==2{print $3}'; done) > "$out/host_adds_mem.txt" & sampler=$!
  python3 "$repo/benchmarks/train_step.py" --arch qwen2 --hidden 3584 --layers 28 --intermediate 18944 --heads 28 \
    --kv-heads 4 --vocab 152064 --batch 1 --seq 2048 --acc 8 --weights bf16 --clip 1.0 --host-model --steps 2 \
    --warmup 2 --vram-cap-gb 24 --modes trainstream+8bit+sr --json "$out/host_adds_qwen24.json" 2>&1 | tail -12
  kill "$sampler"; echo "machine memory in use, peak: $(sort -n "$out/host_adds_mem.txt" | tail -1) MiB"
fi
if has placement; then  # step time against a VRAM cap, TrainStream with no option but clipping, beside the peers
  for acc in 1 8; do
    python3 "$repo/benchmarks/budget_sweep.py" --accs "$acc" --caps none,24,20,16,12,8 \
      --json "$out/sweep_acc$acc.json" --plot "$out/sweep_acc$acc.png" 2>&1 | grep -A40 "^NVIDIA"
  done
fi
if has light; then  # light recompute offered to the planner, against the plan without it, under caps
  python3 "$repo/benchmarks/budget_sweep.py" --accs 1 --caps none,20,16,12 --ours trainstream,trainstream+light \
    --peers gpu-adamw --no-deepspeed --json "$out/sweep_light.json" 2>&1 | grep -A14 "^NVIDIA"
  python3 "$repo/benchmarks/plan_accuracy.py" --vram-budget 20GB --light --json "$out/plan_accuracy_light.json" 2>&1 | tail -16
fi
if has contention; then  # the planned step under 20 and 16 GB caps with clipping (wrap() derives a 15.2 GB
  # budget from a 16 GB cap): where its time goes, then the sweep
  for budget in 20GB 15.2GB; do
    python3 "$repo/benchmarks/step_timeline.py" --mode trainstream+planned --vram-budget "$budget" --clip 1.0 \
      --warmup 5 --steps 4 --json "$out/timeline_planned_$budget.json" 2>&1 | tail -12
  done
  python3 "$repo/benchmarks/budget_sweep.py" --accs 1 --caps 20,16 --ours trainstream --peers gpu-adamw \
    --no-deepspeed --json "$out/sweep_contention.json" 2>&1 | grep -A6 "^NVIDIA"
fi
if has timeline; then  # one accumulation window, forward by backward, against GPU AdamW
  for mode in gpu-adamw trainstream+vramacc; do
    python3 "$repo/benchmarks/step_timeline.py" --mode "$mode" --acc 8 --json "$out/timeline_$mode.json" 2>&1 | tail -20
  done
fi
if has paging; then  # 1B, batch 4x1024: ways to keep activations, on TrainStream
  python3 "$repo/benchmarks/train_step.py" --steps 5 --vram-budget 6GB \
    --modes trainstream,trainstream+auto,trainstream+paged,trainstream+paged+pageonly,trainstream+ckpt,trainstream+save_on_cpu,gpu-adamw \
    --json "$out/paging_1b.json" --plot "$out/paging_1b.png" 2>&1 | tail -24
  python3 "$repo/benchmarks/train_step.py" --steps 10 --vram-budget 6GB --weights bf16 \
    --modes trainstream,trainstream+paged,trainstream+paged+pageonly,trainstream+ckpt,trainstream+save_on_cpu \
    --json "$out/paging_1b_bf16.json" 2>&1 | tail -16
  # why paging costs more than its copy time: copies and the host AdamW share host memory
  python3 "$repo/benchmarks/copy_under_load.py" --json "$out/copy_under_load.json" 2>&1 | tail -6
  python3 "$repo/benchmarks/step_timeline.py" --mode trainstream+paged --weights bf16 --vram-budget 6GB \
    --acc 2 --json "$out/timeline_paged_bf16.json" 2>&1 | tail -11
fi
if has large; then  # the largest models under a 24 GB VRAM cap (Llama 4096-wide, 202M params a layer)
  # fp32 weights, bf16 autocast, batch 1x1024: 20 layers = 4.3B
  python3 "$repo/benchmarks/train_step.py" --hidden 4096 --heads 32 --intermediate 11008 --layers 20 --batch 1 \
    --vram-cap-gb 24 --vram-budget 23GB --steps 2 --warmup 2 --modes trainstream+paged,gpu-adamw \
    --json "$out/large_fp32.json" 2>&1 | tail -9
  # bf16 weights, batch 4x1024: 24 layers = 5.1B
  python3 "$repo/benchmarks/train_step.py" --hidden 4096 --heads 32 --intermediate 11008 --layers 24 --batch 4 \
    --weights bf16 --vram-cap-gb 24 --vram-budget 23GB --steps 2 --warmup 2 --modes trainstream+paged,gpu-adamw \
    --json "$out/large_bf16.json" 2>&1 | tail -9
  # bf16 weights, batch 1x1024: 30 layers = 6.3B
  python3 "$repo/benchmarks/train_step.py" --hidden 4096 --heads 32 --intermediate 11008 --layers 30 --batch 1 \
    --weights bf16 --vram-cap-gb 24 --vram-budget 23GB --steps 2 --warmup 2 --modes trainstream+paged,gpu-adamw \
    --json "$out/large_bf16_b1.json" 2>&1 | tail -9
fi
# A Llama with 4096-wide layers (bf16 weights, batch 1x1024, clipping) built in host memory and
# trained under a VRAM cap, in a process of its own with the host's memory sampled every 4 s
stream_run() {  # mode:layers:cap_GB
  local mode layers cap name sampler
  IFS=: read -r mode layers cap <<< "$1"
  name="stream_${layers}l_${cap}gb_$mode"
  (while sleep 4; do echo "$(date +%s) $(free -m | awk 'NR==2{print "used_MB=" $3, "available_MB=" $7}')"; done) \
    > "$out/host_memory_$name.log" & sampler=$!
  timeout 300 python3 -u "$repo/benchmarks/train_step.py" --hidden 4096 --heads 32 --intermediate 11008 --batch 1 \
    --seq 1024 --weights bf16 --clip 1.0 --host-model --layers "$layers" --vram-cap-gb "$cap" \
    --steps 3 --warmup 2 --modes "$mode" --json "$out/$name.json" > "$out/$name.log" 2>&1
  echo "$name: exit $?, host memory used at most $(awk -F'used_MB=' '{split($2, a, " ")
    if (a[1] + 0 > m) m = a[1] + 0} END {print m}' "$out/host_memory_$name.log") MB"
  kill $sampler; tail -3 "$out/$name.log"
}
if has streaming; then  # the 6.33B model (30 layers) under 12 GB against DeepSpeed ZeRO-3 with
  # parameters and optimizer offloaded, then the 6.74B one (32 layers) under 24 GB
  for run in trainstream:30:12 deepspeed3:30:12 trainstream:32:24; do stream_run "$run"; done
  dmesg 2>/dev/null | grep -iE "killed process" | tail -2
fi
if has stream_limit; then  # where host memory ends under 24 GB: 7.15B (34 layers), then 7.55B (36)
  for run in trainstream:34:24 trainstream:36:24; do stream_run "$run"; done
  dmesg 2>/dev/null | grep -iE "killed process" | tail -2
fi
if has stream_price; then  # the price of streaming: the 0.95B model down to caps its weights do not fit
  python3 "$repo/benchmarks/budget_sweep.py" --accs 1 --caps none,6,4.5,3.5 --peers "" --no-deepspeed --host-model \
    --steps 4 --warmup 4 --json "$out/stream_price.json" 2>&1 | grep -A8 "^NVIDIA"
  python3 "$repo/benchmarks/plan_accuracy.py" --vram-budget 20GB --json "$out/plan_accuracy_20gb.json" 2>&1 | tail -12
  (cd /tmp && timeout 300 compute-sanitizer --tool memcheck python3 -m pytest "$repo/tests/test_streaming.py" -q -x \
    -k "cuda and same_bits and 1-None" 2>&1) > "$out/sanitizer_memcheck_streaming.log"; grep -E "SUMMARY|passed|failed" "$out/sanitizer_memcheck_streaming.log" | tail -3
fi
if has distributed; then  # several GPUs: the NCCL tests with one rank per GPU, then the benchmark on 2 and 4
  (cd /tmp && python3 -m pytest "$repo/tests/test_distributed.py" -q -k "every-gpu" 2>&1 | tail -3) | tee "$out/distributed_tests.log"
  for n in 2 4; do
    [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge $n ] || continue
    python3 "$repo/benchmarks/distributed_step.py" --gpus $n --json "$out/distributed_${n}gpu.json" 2>&1 | tail -8
  done
fi
if has sanitize; then
  # memcheck over real training steps (fp32 parity cases, one of them with the accumulate kernel,
  # and the update terms staged whole and in pieces);
  # racecheck over our kernel only: under it, torch's cuDNN attention backward reports hazards of its own
  san() {  # tool log tests -k
    (cd /tmp && timeout 300 compute-sanitizer --tool "$1" --target-processes all python3 -m pytest $3 -q -x -k "$4" 2>&1) \
      > "$out/$2" ; echo "$1: rc=$?"; grep -E "SUMMARY|passed|failed" "$out/$2" | tail -3
  }
  san memcheck sanitizer_memcheck.log "$repo/tests/test_wrap_gpu.py $repo/tests/test_device_accumulate_gpu.py" \
    "parity_on_gpu and fp32 and not vram or update_terms or n4099 and float32 and not offset"
  san racecheck sanitizer_racecheck.log "$repo/tests/test_device_accumulate_gpu.py" "n4099 and float32 and not offset"
  # the bf16 scan and pack kernels: every size and alignment, an inexact value first, last or none
  pack="$repo/tests/test_grad_packing_gpu.py"
  san memcheck sanitizer_memcheck_pack.log "$pack" "not middle"
  san racecheck sanitizer_racecheck_pack.log "$pack" "not middle"
fi
