#!/usr/bin/env bash
# A local Ray head bound to 127.0.0.1 with the dashboard (the Ray Jobs API needs it), for the demo,
# the tests and CI. Every port is a free one picked at start (so two heads on one machine do not
# clash), the object store is capped, and stop ends exactly the processes this head started.
#
#   scripts/ray_head.sh start [STATE_DIR]   # prints RAY_ADDRESS=http://127.0.0.1:PORT (Jobs API) and RAY_GCS=127.0.0.1:PORT
#   scripts/ray_head.sh stop  [STATE_DIR]
#   scripts/ray_head.sh status [STATE_DIR]
#
# STATE_DIR (default $KVLEAGUE_RAY_STATE, else /tmp/kvleague-ray) holds head.pid, env and head.log.
# Tunables: KVLEAGUE_RAY_CPUS (default: nproc), KVLEAGUE_RAY_OBJECT_STORE_BYTES (default 300 MB),
# KVLEAGUE_RAY_START_TIMEOUT (seconds, default 120).
# Then: . STATE_DIR/env && ray job submit --working-dir . -- python runner/sweep.py --config sweeps/demo.yaml
set -euo pipefail

cmd=${1:-}
state=${2:-${KVLEAGUE_RAY_STATE:-/tmp/kvleague-ray}}
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$here/.venv/bin/ray" ]; then
  . "$here/.venv/bin/activate"
fi
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
# Token authentication, explicitly: the head and every client (ray job submit, ray.init) read the
# token from ~/.ray/auth_token (created here if missing), so only this user can submit jobs.
export RAY_AUTH_MODE=token

free_ports() {  # N distinct free TCP ports on 127.0.0.1
  python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
EOF
}

session_pids() {  # every process in the session the head's setsid opened (pid == sid)
  ps -eo pid=,sid= | awk -v sid="$1" '$2 == sid {print $1}'
}

alive() { [ -f "$state/head.pid" ] && kill -0 "$(cat "$state/head.pid")" 2>/dev/null; }

case "$cmd" in
  start)
    if alive; then
      echo "ray head already running (pid $(cat "$state/head.pid")); env in $state/env" >&2
      cat "$state/env"
      exit 0
    fi
    mkdir -p "$state"
    ray get-auth-token --generate >/dev/null
    # Ray gives its own processes ~30 s to come up; on a loaded machine the GCS can miss that and the
    # head exits ("timed out during startup"): such a start is tried once more, on fresh ports
    for attempt in 1 2; do
      read -r gcs dash client agent_http agent_grpc env_agent metrics nm om <<<"$(free_ports 9)"
      # Ray's unix sockets live under the temp dir: keep its path short (108-byte socket path limit)
      tmp=$(mktemp -d /tmp/kvlray.XXXXXX)
      setsid ray start --head --block \
        --node-ip-address 127.0.0.1 --port "$gcs" \
        --include-dashboard=true --dashboard-host 127.0.0.1 --dashboard-port "$dash" \
        --ray-client-server-port "$client" --dashboard-agent-listen-port "$agent_http" \
        --dashboard-agent-grpc-port "$agent_grpc" --runtime-env-agent-port "$env_agent" \
        --metrics-export-port "$metrics" --node-manager-port "$nm" --object-manager-port "$om" \
        --num-cpus "${KVLEAGUE_RAY_CPUS:-$(nproc)}" \
        --object-store-memory "${KVLEAGUE_RAY_OBJECT_STORE_BYTES:-300000000}" \
        --temp-dir "$tmp" --disable-usage-stats \
        >"$state/head.log" 2>&1 </dev/null &
      echo $! >"$state/head.pid"
      printf 'export RAY_ADDRESS=http://127.0.0.1:%s\nexport RAY_GCS=127.0.0.1:%s\nexport RAY_AUTH_MODE=token\nexport RAY_TEMP_DIR=%s\n' "$dash" "$gcs" "$tmp" >"$state/env"
      deadline=$((SECONDS + ${KVLEAGUE_RAY_START_TIMEOUT:-120}))
      up=""
      until ray job list --address "http://127.0.0.1:$dash" >/dev/null 2>&1 && up=1; do
        if ! alive; then
          break
        fi
        if [ $SECONDS -ge $deadline ]; then
          echo "ray head: Jobs API not up after ${KVLEAGUE_RAY_START_TIMEOUT:-120}s; log:" >&2
          tail -20 "$state/head.log" >&2
          "$0" stop "$state" >/dev/null 2>&1 || true
          exit 1
        fi
        sleep 1
      done
      [ -n "$up" ] && break
      if [ "$attempt" = 2 ] || ! grep -q "timed out during startup" "$state/head.log"; then
        echo "ray head failed to start; log:" >&2
        tail -20 "$state/head.log" >&2
        "$0" stop "$state" >/dev/null 2>&1 || true
        exit 1
      fi
      echo "ray head timed out during startup (a loaded machine); starting it once more" >&2
      "$0" stop "$state" >/dev/null 2>&1 || true
      mkdir -p "$state"
    done
    cat "$state/env"
    ;;
  stop)
    if [ ! -f "$state/head.pid" ]; then
      echo "no ray head recorded in $state" >&2
      exit 0
    fi
    pid=$(cat "$state/head.pid")
    # SIGTERM to `ray start --block` makes it stop the processes it started; then sweep the session.
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do
      [ -z "$(session_pids "$pid")" ] && break
      sleep 0.5
    done
    left=$(session_pids "$pid")
    if [ -n "$left" ]; then
      kill -TERM $left 2>/dev/null || true
      sleep 2
      left=$(session_pids "$pid")
      [ -z "$left" ] || kill -KILL $left 2>/dev/null || true
    fi
    if [ -f "$state/env" ]; then
      tmp=$(sed -n 's/^export RAY_TEMP_DIR=//p' "$state/env")
      case "$tmp" in /tmp/kvlray.*) rm -rf "$tmp" ;; esac
    fi
    rm -f "$state/head.pid" "$state/env"
    echo "ray head stopped"
    ;;
  status)
    if alive; then
      echo "running (pid $(cat "$state/head.pid"))"
      cat "$state/env"
    else
      echo "not running"
      exit 1
    fi
    ;;
  *)
    echo "usage: $0 start|stop|status [STATE_DIR]" >&2
    exit 2
    ;;
esac
