#!/usr/bin/env bash
# The demo on the embedded default: sweeps/demo.yaml (an offline model, the foundation methods, two
# budgets, samples of every domain) on a local Ray bound to 127.0.0.1, results in SQLite, then the
# leaderboard. A re-run resumes: finished cells are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVLEAGUE_DATA_DIR=${KVLEAGUE_DATA_DIR:-$(cd .. && pwd)/shared/data}
export KVLEAGUE_DB=${KVLEAGUE_DB:-sqlite:///kvleague.db}
[ -f artifacts/tiny-llama/config.json ] || kvleague make-tiny-model --arch llama --out artifacts/tiny-llama >/dev/null
kvleague sweep --config sweeps/demo.yaml
echo
echo "Leaderboard: kvleague dashboard --db $KVLEAGUE_DB   (serves http://127.0.0.1:8501)"
