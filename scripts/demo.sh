#!/usr/bin/env bash
# The demo on the default model: sweeps/demo.yaml (SmolLM2-135M-Instruct from its PyPI wheel, seven
# methods, two budgets, needle-in-a-haystack) on a local Ray bound to 127.0.0.1, results in SQLite,
# then the leaderboard. The first run converts the model once (~18 s) into ~/.cache/kvleague/models.
# A re-run resumes: finished cells are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
KVLEAGUE_EXTRAS=${KVLEAGUE_EXTRAS-} bash scripts/setup.sh   # the demo needs no test extras
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export KVLEAGUE_DATA_DIR=${KVLEAGUE_DATA_DIR:-$(cd .. && pwd)/shared/data}
export KVLEAGUE_DB=${KVLEAGUE_DB:-sqlite:///kvleague.db}
kvleague sweep --config sweeps/demo.yaml "$@"
echo
echo "Leaderboard: kvleague dashboard --db $KVLEAGUE_DB   (serves http://127.0.0.1:8501)"
