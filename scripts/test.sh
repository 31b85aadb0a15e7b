#!/usr/bin/env bash
# The test command: set up (idempotent), lint and format checks, install/start what the tests need, run
# the whole suite offline.
# Debian chromium (dashboard browser test), libseccomp (the code sandbox) and a throwaway PostgreSQL on
# 127.0.0.1 (DB tests on a real server) need root on a fresh machine; without them those tests skip,
# except under CI, where a failed install fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVLEAGUE_DATA_DIR=${KVLEAGUE_DATA_DIR:-$(cd .. && pwd)/shared/data}

# lint and format first: seconds, and a finding fails the run before the suite's minutes
ruff check . && ruff format --check . >/dev/null || { echo "scripts/test.sh: ruff found the above (ruff check --fix . && ruff format .)" >&2; exit 1; }
# types: pyright over pyrightconfig.json's folders (a minute of CPU), in the background beside the
# suite's waits on subprocesses and servers; its findings fail the run after the suite, shown only then
types_out=$(mktemp /tmp/kvleague-pyright.XXXXXX)
pyright >"$types_out" 2>&1 &
types_pid=$!
pg_dir=""
cleanup() {
  kill "$types_pid" 2>/dev/null || true
  rm -f "$types_out"
  if [ -n "$pg_dir" ]; then bash scripts/postgres.sh stop "$pg_dir" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
types_check() {
  wait "$types_pid" && return 0
  grep -v '^ *$' "$types_out" | tail -60 >&2
  echo "scripts/test.sh: pyright found the above" >&2
  return 1
}

# chromium serves only the browser test, which is in the slow tier: CI's tier skips its apt install
if [ -n "${KVLEAGUE_SLOW:-}" ]; then bash scripts/chromium.sh || [ -z "${CI:-}" ]; fi
bash scripts/seccomp.sh || [ -z "${CI:-}" ]
pg_dir=$(mktemp -d /tmp/kvleague-pg-test.XXXXXX)
if url=$(bash scripts/postgres.sh start "$pg_dir" | tail -1); then
  export KVLEAGUE_PG_URL=$url
elif [ -n "${CI:-}" ]; then
  exit 1
fi
# One torch thread per test process, two processes (whole files each, so module fixtures such as a
# Ray head are made once, the longest first: tests/conftest.py): faster on 2 cores than one process
# with two threads, and never more threads than cores. KVLEAGUE_TEST_WORKERS=0 runs in one process.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
workers=${KVLEAGUE_TEST_WORKERS:-2}
# The slow tier (tests marked slow: Ray end-to-end sweeps, fault injection, the browser, the GPU script on
# the CPU; about ten minutes more on 2 cores) runs with KVLEAGUE_SLOW=1; CI runs the rest within its budget.
tier=(-m "not slow")
[ -n "${KVLEAGUE_SLOW:-}" ] && tier=()
status=0
if [ "$workers" = 0 ]; then
  python -m pytest -q "${tier[@]}" "$@" || status=$?
else
  python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder --durations=25 "${tier[@]}" "$@" || status=$?
fi
types_check || status=1
exit "$status"
