#!/bin/bash
# The issue-30 signal study in the paper's regime on SmolLM2-135M: each sample's answer is the model's own
# greedy full-cache trace of 256 tokens (special tokens suppressed, runner.fidelity.self_traces), the
# occlusion windows (32 tokens every 32) slide over the trace only, each scored on the trace tokens after
# it. Same 30 samples per task as results/signals/run.sh (sample seed 0). Two tasks at a time, one core and
# one torch thread each, from a clean worktree of the commit (git worktree add --detach /tmp/kvl-signals-trace
# <commit>); --max-seconds guards a shared deadline (DEADLINE, epoch seconds; none was reached: 30 of 30 each).
#   DEADLINE=$(date -u -d '+2 hours' +%s) bash results/signals/trace/run.sh kv_agent niah
#   DEADLINE=... bash results/signals/trace/run.sh math500 humaneval
cd /tmp/kvl-signals-trace
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 KVLEAGUE_DATA_DIR=${KVLEAGUE_DATA_DIR:-/work/shared/data} OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
OUT=${OUT:-/work/main/results/signals/trace}
DB=${DB:-sqlite:////work/main/results/signals.db}
DEADLINE=${DEADLINE:-$(date -u -d '+2 hours' +%s)}
one() {  # task, extra options
  local task=$1; shift
  local budget=$(( DEADLINE - $(date -u +%s) ))
  echo "=== $task start $(date -u +%H:%M:%S) commit $(git rev-parse --short HEAD) max-seconds $budget" >> $OUT/run.log
  /usr/bin/time -v python -m kvleague.cli signals --model smollm2-135m --task $task "$@" \
    --limit 30 --trace self --max-tokens 256 --occlude trace --trace-batch 10 --stride 32 --window 32 --threads 1 \
    --max-seconds $budget --db $DB --json $OUT/smollm2_$task.json > $OUT/smollm2_$task.log 2>&1
  echo "=== $task end $(date -u +%H:%M:%S) rc=$?" >> $OUT/run.log
}
for task in "$@"; do
  if [ "$task" = niah ]; then one niah --option context_length=512 & else one "$task" & fi
done
wait
