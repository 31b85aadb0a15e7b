#!/bin/bash
# The issue-21 signal study on SmolLM2-135M (second run: 30 samples per domain, no time limit, the
# position-controlled rho, the answer-flip label on niah), one core, from a clean worktree of the commit
# (git worktree add --detach /tmp/kvl-signals-run2 <commit>). Longest tasks first.
cd /tmp/kvl-signals-run2
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 KVLEAGUE_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
OUT=/work/main/results/signals
DB=sqlite:////work/main/results/signals.db
# the machine's load, once a minute, for the report
(while true; do echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 60; done) > $OUT/load.log &
SAMPLER=$!
run() {  # task, extra options
  local task=$1; shift
  echo "=== $task start $(date -u +%H:%M:%S) commit $(git rev-parse --short HEAD)" >> $OUT/run.log
  nice -n 5 /usr/bin/time -v /work/main/.venv/bin/python -m kvleague.cli signals --model smollm2-135m --task $task "$@" \
    --limit 30 --stride 32 --window 32 --threads 1 --db $DB --json $OUT/smollm2_$task.json \
    > $OUT/smollm2_$task.log 2>&1
  echo "=== $task end $(date -u +%H:%M:%S) rc=$?" >> $OUT/run.log
}
run niah --option context_length=512 --flip-label --flip-tokens 24  # SmolLM2's answers are 21-24 tokens
run kv_agent
run humaneval
run math500
kill $SAMPLER
