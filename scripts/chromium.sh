#!/usr/bin/env bash
# Install Debian's chromium if it is missing: the dashboard's browser test drives /usr/bin/chromium
# (headless, through the python playwright package; no browser is ever downloaded). Idempotent.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" scripts/chromium.sh "install a chromium at /usr/bin/chromium" chromium
echo "scripts/chromium.sh: installed $(/usr/bin/chromium --version 2>/dev/null | head -1)"
