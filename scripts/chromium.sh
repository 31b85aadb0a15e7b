#!/usr/bin/env bash
# Install Debian's chromium if it is missing: the dashboard's browser test drives /usr/bin/chromium
# (headless, through the python playwright package; no browser is ever downloaded). Idempotent.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "scripts/chromium.sh: no apt-get here; install a chromium at /usr/bin/chromium" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q chromium >/dev/null
echo "scripts/chromium.sh: installed $(/usr/bin/chromium --version 2>/dev/null | head -1)"
