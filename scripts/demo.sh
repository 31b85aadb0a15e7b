#!/usr/bin/env bash
# The demo on the embedded default: a tiny model built offline, every registered method on one prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=artifacts/tiny-llama
[ -f "$MODEL/config.json" ] || kvleague make-tiny-model --arch llama --out "$MODEL" >/dev/null
PROMPT="Eviction keeps a budget of tokens; the rest of the cache is dropped. Which tokens matter?"
printf '%-16s %8s %9s %9s %12s %10s\n' method budget evictions peak_kv tokens/s method_ms
for method in $(kvleague methods --json | python -c "import json,sys; print(' '.join(m['name'] for m in json.load(sys.stdin)))"); do
  kvleague generate --model "$MODEL" --method "$method" --budget 64 --sink 4 --recent 8 \
    --prompt "$PROMPT" --max-new-tokens 64 --json |
  python -c "import json,sys; r=json.load(sys.stdin); print(f\"{r['method']:<16} {r['budget']:>8} {r['evictions']:>9} {r['peak_kv_bytes']:>9} {r['tokens_per_second']:>12.1f} {1000*r['method_seconds']:>10.2f}\")"
done
