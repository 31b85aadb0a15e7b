#!/usr/bin/env bash
# scripts/apt_install.sh WHO HINT PACKAGE...: install Debian packages with apt-get (through sudo when
# not root), for the set-up scripts that need a system component; WHO names the caller in messages,
# HINT says what to install by hand where there is no apt-get.
set -euo pipefail
who=$1 hint=$2
shift 2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "$who: no apt-get here; $hint" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q "$@" >/dev/null
