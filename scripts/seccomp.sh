#!/usr/bin/env bash
# Install Debian's libseccomp if it is missing: the code sandbox's seccomp filter (it denies unix
# sockets) is built by libseccomp through the pyseccomp package, and without it the sandbox refuses
# to run generated code. Idempotent; Debian's base system usually has it already (apt needs it).
set -euo pipefail
if ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null; then  # no -q: an early exit would fail the pipe
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" scripts/seccomp.sh "install libseccomp (libseccomp.so.2)" libseccomp2
echo "scripts/seccomp.sh: installed libseccomp2"
