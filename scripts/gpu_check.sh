#!/usr/bin/env bash
# The GPU check: the one command a user with a CUDA GPU runs to check an install.
#
#   bash scripts/gpu_check.sh [OUT_DIR]              # default gpu-check/; every step
#   GPU_CHECK_STEPS="tests generate" bash scripts/gpu_check.sh OUT_DIR   # some steps, in the order below
#
# Steps, most important first (a short GPU lease runs the first ones; docs/gpu.md gives their times):
#   tests      the CUDA tests (`pytest -m cuda`): the engine against model.generate and eager attention
#              on the GPU, ragged batches against each sequence alone, every registered method on CUDA
#              against CPU, and every method's decode steps captured as CUDA graphs (slab backend)
#              against the hf backend;
# The steps after `tests` run in bf16 on a random-weight llama of 0.57B parameters (16 layers, hidden
# 2048, 32/8 heads), built offline first when missing (step `model` in summary.txt):
#   generate   batch 1, no eviction, prompt 1024, 256 new: the hf and slab engines beside
#              model.generate and model.generate with HF's static cache compiled by transformers; the
#              first decode over new KV lengths against a second;
#   batch      prompt 400, 64 new, B = 200: full and epikv at batch 1 and 32, both backends;
#   attention  the same for snapkv and h2o (attention-reading methods);
#   busy       the torch profiler over 16 steady-state decode steps (full and epikv, batch 1 and 32,
#              both backends): the share of each step the GPU is busy, kernels per token, host ops
#              per step;
#   static32   batch 32, full, slab backend beside the static-cache anchor at batch 32;
#   speed      `bench speed` at B = 256 for six methods, both backends;
#   kvpress    the engine against kvpress's DecodingPress, B = 256;
#   cudnn      the first-pass figure with SDPA's cuDNN kernel allowed (what the engine turns off, and why);
#   context    the longest context that fits 8 GiB for full, knorm and snapkv;
#   refill     continuous batching against fixed chunks: 96 random prompts of 200-400 tokens, 32 rows,
#              B = 200, up to 128 new, an EOS token that spreads the lengths (`--eos-token auto`),
#              full and epikv on the slab backend (not among the default steps: GPU_CHECK_STEPS=refill).
# Wall clock with the device synchronized; each step under its own time limit. Everything lands in
# OUT_DIR: one log and one JSON report per step, and summary.txt (step, exit code, seconds). First,
# the GPU's device-to-device copy bandwidth goes to bandwidth.json; last, step `targets` (`kvleague
# bench targets OUT_DIR`, which also rebuilds the table anywhere from the folder) writes targets.md:
# the fast backend's targets against the figures of the steps that ran, and each figure's share of
# the memory-bandwidth bound. Exit code: 0 when every step run passed.
#
# GPU_CHECK_CPU=1: a dry run of these same steps on the CPU, on a tiny random llama (4 layers, hidden
# 64) instead of the 0.57B one, so a GPU lease never meets a broken step; no figure it writes is a GPU
# figure (the targets table says so). Pick short steps (tests/test_gpu_check.py runs `tests cudnn`).
#
# Python: .venv's when scripts/setup.sh made one, else $PYTHON or python3 (e.g. an image with its
# own CUDA torch, the project's other pins on PYTHONPATH); the repository goes first on PYTHONPATH,
# so an uninstalled checkout runs too.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
models=${KVLEAGUE_BENCH_MODELS:-/tmp/kvleague-bench-models}
cpu_dry_run=${GPU_CHECK_CPU:-}
if [ -n "$cpu_dry_run" ]; then
  model=$models/llama-tiny model_size=()
else
  model=$models/llama-0.57b model_size=(--layers 16 --hidden 2048 --heads 32 --kv-heads 8)
fi
failed=0
: >"$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log, record the outcome
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  printf '%-16s rc=%-3s %4ss\n' "$name" "$rc" "$(($(date +%s) - start))" | tee -a "$out/summary.txt"
  [ "$rc" = 0 ] || { failed=1; tail -n 5 "$out/$name.log"; }
}

"$PY" - >"$out/environment.txt" 2>&1 <<'EOF'
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF
cat "$out/environment.txt"
if [ -n "$cpu_dry_run" ]; then
  echo "gpu_check: a dry run on the CPU (GPU_CHECK_CPU): no figure here is a GPU figure"
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: torch sees no CUDA device (GPU_CHECK_CPU=1 runs the steps on the CPU)" >&2; exit 2; }
fi
# the memory-bandwidth bound's numerator, first: a check cut short still leaves it in the folder
"$PY" -c "import sys; from kvleague.runner.bench.gpu_targets import record_bandwidth; record_bandwidth(sys.argv[1])" "$out" \
  || echo "gpu_check: the copy bandwidth was not measured" >&2

steps=" ${GPU_CHECK_STEPS:-tests generate batch attention busy static32 speed kvpress cudnn context} "
wants() { [[ $steps == *" $1 "* ]]; }
bench() { local name=$1 limit=$2; shift 2; step "$name" "$limit" "$PY" -m kvleague.cli bench "$@" --model "$model" --json "$out/$name.json"; }
both=(--backend hf --backend slab)

wants tests && step cuda-tests 300 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_batch_cuda.py tests/test_slot_order.py tests/test_grouped_eager.py \
  tests/test_backend_slab.py --junitxml "$out/cuda-tests.xml"
[[ -f $model/model.safetensors || $steps == " tests " ]] || step model 240 "$PY" -m kvleague.cli make-tiny-model \
  --arch llama "${model_size[@]}" --out "$model"
wants generate && bench generate 300 generate --prompt-tokens 1024 --new-tokens 256 --rounds 2 --clock wall "${both[@]}" --static-anchor
wants batch && bench batch 150 batch --prompt-tokens 400 --new-tokens 64 --budget 200 --batch-sizes 1,32 --methods full,epikv \
  --clock wall "${both[@]}"
wants attention && bench batch-attention 150 batch --prompt-tokens 400 --new-tokens 64 --budget 200 --batch-sizes 1,32 \
  --methods snapkv,h2o --clock wall "${both[@]}"
wants busy && bench busy 120 busy --methods full,epikv --batch-sizes 1,32 --steps 16 "${both[@]}"
wants static32 && bench static32 150 batch --prompt-tokens 400 --new-tokens 64 --budget 200 --batch-sizes 32 --methods full \
  --clock wall --backend slab --static-anchor
wants speed && bench speed 150 speed --budgets 256 --gen-factor 1 --methods epikv knorm tova snapkv h2o --clock wall "${both[@]}"
wants kvpress && bench kvpress 120 kvpress --budgets 256 --new-tokens 128 --rounds 1 --clock wall "${both[@]}"
wants cudnn && bench generate-cudnn 90 generate --prompt-tokens 256 --new-tokens 64 --rounds 1 --clock wall --cudnn-attention
wants context && bench context 150 context --methods full knorm snapkv --memory-gib 8 --max-tokens 16384 --probe-timeout 60
wants refill && bench refill 180 refill --task random --prompt-tokens 400 --samples 96 --batch-size 32 --budget 200 \
  --new-tokens 128 --eos-token auto --methods full,epikv --clock wall --backend slab
[[ $steps == " tests " ]] || step targets 60 "$PY" -m kvleague.cli bench targets "$out"

echo "gpu_check: $([ $failed = 0 ] && echo all steps passed || echo some steps FAILED); reports in $out/"
exit $failed
