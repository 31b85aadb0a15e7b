#!/usr/bin/env bash
# The GPU check: the one command a user with a CUDA GPU runs to check an install.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default gpu-check/
#
# 1. the CUDA tests (`pytest -m cuda`): the engine against model.generate and eager attention on the
#    GPU, ragged batches against each sequence alone, every registered method on CUDA against CPU,
#    the slab backend's captured decode steps against the hf backend;
# 2. a random-weight llama of 0.57B parameters (16 layers, hidden 2048, 32/8 heads) built offline;
# 3. on it, in bf16: `kvleague bench generate / batch / speed / kvpress / context` (and speed on both
#    backends, hf and slab), wall clock with
#    the device synchronized, each under its own time limit.
# Everything lands in OUT_DIR: one log and one JSON report per step, and summary.txt (step, exit
# code, seconds). Exit code: 0 when every step passed. About 6 minutes on an H200 (docs/gpu.md).
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
model=$models/llama-0.57b
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
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_check: torch sees no CUDA device" >&2; exit 2; }

step cuda-tests 300 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_batch_cuda.py tests/test_backend_slab.py \
  --junitxml "$out/cuda-tests.xml"
[ -f "$model/model.safetensors" ] || step model 240 "$PY" -m kvleague.runner.cli make-tiny-model --arch llama --layers 16 \
  --hidden 2048 --heads 32 --kv-heads 8 --out "$model"
bench() { local name=$1 limit=$2; shift 2; step "$name" "$limit" "$PY" -m kvleague.runner.cli bench "$@" --model "$model" --json "$out/$name.json"; }
# batch 1, no eviction: the engine against model.generate; the first decode over new KV lengths against a second
bench generate 150 generate --prompt-tokens 1024 --new-tokens 256 --rounds 2 --clock wall
# the same first-pass figure with SDPA's cuDNN kernel allowed: what the engine turns off, and why
bench generate-cudnn 90 generate --prompt-tokens 256 --new-tokens 64 --rounds 1 --clock wall --cudnn-attention
bench batch 180 batch --prompt-tokens 400 --new-tokens 64 --budget 200 --batch-sizes 1,8,32 --methods full,epikv --clock wall
bench batch-attention 150 batch --prompt-tokens 400 --new-tokens 64 --budget 200 --batch-sizes 1,8 --methods h2o,snapkv --clock wall
bench speed 150 speed --budgets 256 --gen-factor 1 --methods epikv knorm tova snapkv h2o --clock wall
bench kvpress 120 kvpress --budgets 256 --new-tokens 128 --rounds 1 --clock wall
# the slab backend (fixed slabs, CUDA-graph decode steps) beside hf, one run: knorm's steps are captured, snapkv's not
bench slab-speed 150 speed --budgets 256 --gen-factor 1 --methods knorm snapkv --clock wall --backend hf --backend slab
bench context 150 context --methods full knorm snapkv --memory-gib 8 --max-tokens 16384 --probe-timeout 60

echo "gpu_check: $([ $failed = 0 ] && echo all steps passed || echo some steps FAILED); reports in $out/"
exit $failed
