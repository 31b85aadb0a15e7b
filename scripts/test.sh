#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVLEAGUE_DATA_DIR=${KVLEAGUE_DATA_DIR:-$(cd .. && pwd)/shared/data}
python -m pytest -q "$@"
