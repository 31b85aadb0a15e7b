#!/usr/bin/env bash
# Install Debian's libseccomp if it is missing: the code sandbox's seccomp filter (it denies unix
# sockets) is built by libseccomp through the pyseccomp package, and without it the sandbox refuses
# to run generated code. Idempotent; Debian's base system usually has it already (apt needs it).
set -euo pipefail
if ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null; then  # no -q: an early exit would fail the pipe
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "scripts/seccomp.sh: no apt-get here; install libseccomp (libseccomp.so.2)" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q libseccomp2 >/dev/null
echo "scripts/seccomp.sh: installed libseccomp2"
