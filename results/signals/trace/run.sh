#!/bin/bash
# The issue-30 signal study in the paper's regime on SmolLM2-135M: each sample's answer is the model's own
# greedy full-cache trace of 256 tokens (special tokens suppressed, runner.fidelity.self_traces), the
# occlusion windows (32 tokens every 32) slide over the trace only, each scored on the trace tokens after
# it. Same 30 samples per task as results/signals/run.sh (sample seed 0). One core, one torch thread,
# from a clean worktree of the commit (git worktree add --detach /tmp/kvl-signals-trace <commit>).
# A shared deadline: each task may start new samples for (time left to DEADLINE) / (tasks left)
# seconds (--max-seconds; samples run in a seeded random order, so those studied are a uniform subset).
cd /tmp/kvl-signals-trace
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 KVLEAGUE_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
OUT=/work/wt-signals/results/signals/trace
DB=sqlite:////work/wt-signals/results/signals.db
DEADLINE=${DEADLINE:-$(date -u -d '22:40' +%s)}
(while true; do echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 60; done) > $OUT/load.log &
SAMPLER=$!
LEFT=4
run() {  # task, extra options
  local task=$1; shift
  local budget=$(( ($DEADLINE - $(date -u +%s)) / LEFT ))
  LEFT=$((LEFT - 1))
  echo "=== $task start $(date -u +%H:%M:%S) commit $(git rev-parse --short HEAD) max-seconds $budget" >> $OUT/run.log
  nice -n 5 /usr/bin/time -v /work/main/.venv/bin/python -m kvleague.runner.cli signals --model smollm2-135m --task $task "$@" \
    --limit 30 --trace self --max-tokens 256 --occlude trace --trace-batch 10 --stride 32 --window 32 --threads 1 \
    --max-seconds $budget --db $DB --json $OUT/smollm2_$task.json > $OUT/smollm2_$task.log 2>&1
  echo "=== $task end $(date -u +%H:%M:%S) rc=$?" >> $OUT/run.log
}
run math500
run humaneval
run kv_agent
run niah --option context_length=512
kill $SAMPLER
