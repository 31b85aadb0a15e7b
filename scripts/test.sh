#!/usr/bin/env bash
# The test command: set up (idempotent), install/start what the tests need, run the whole suite offline.
# Debian chromium (dashboard browser test) and a throwaway PostgreSQL on 127.0.0.1 (DB tests on a real
# server) need root on a fresh machine; without them those tests skip, except under CI, where a failed
# install fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVLEAGUE_DATA_DIR=${KVLEAGUE_DATA_DIR:-$(cd .. && pwd)/shared/data}

bash scripts/chromium.sh || [ -z "${CI:-}" ]
pg_dir=$(mktemp -d /tmp/kvleague-pg-test.XXXXXX)
if url=$(bash scripts/postgres.sh start "$pg_dir" | tail -1); then
  export KVLEAGUE_PG_URL=$url
  trap 'bash scripts/postgres.sh stop "$pg_dir" >/dev/null 2>&1 || true' EXIT
elif [ -n "${CI:-}" ]; then
  exit 1
fi
python -m pytest -q "$@"
