#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for tests, CI and local sweeps.
#
#   scripts/postgres.sh start [DIR]   # installs Debian's postgresql if missing, starts a server, prints its URL
#   scripts/postgres.sh url   [DIR]   # prints the URL of the running server
#   scripts/postgres.sh pause [DIR]   # stops it, keeping its data (resume starts it again on the same port)
#   scripts/postgres.sh stop  [DIR]   # stops it and deletes DIR
#
# DIR (default $KVLEAGUE_PG_DIR, else /tmp/kvleague-pg; made mode 0700) holds the data directory, the
# socket (mode 0700), the log, the port and the superuser's random password (mode 0600). The server
# listens on 127.0.0.1 only, on a free port, asks every connection, local or TCP, for that password
# (scram-sha-256: no other local user, nor a program in the code sandbox, gets in) and has a database
# "kvleague". As root the server runs as the postgres user.
# URL (it holds the password: keep it out of argv and logs): postgresql+psycopg://postgres:PASSWORD@127.0.0.1:PORT/kvleague
set -euo pipefail

cmd=${1:-}
dir=${2:-${KVLEAGUE_PG_DIR:-/tmp/kvleague-pg}}

find_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
  return 1
}

install_postgres() {
  if [ "$(id -u)" != 0 ]; then
    echo "postgres.sh: PostgreSQL server binaries not found and not root; install Debian's postgresql package" >&2
    exit 1
  fi
  # no default cluster on port 5432: this script starts its own servers
  mkdir -p /etc/postgresql-common
  [ -f /etc/postgresql-common/createcluster.conf ] || echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.conf
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq postgresql >/dev/null
}

as_owner() {  # run a server binary as the data directory's owner
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

url() { echo "postgresql+psycopg://postgres:$(cat "$dir/password")@127.0.0.1:$(cat "$dir/port")/kvleague"; }

launch() {  # start the server of $dir on its port
  local port
  port=$(cat "$dir/port")
  as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c unix_socket_permissions=0700 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
    start >/dev/null || { tail -20 "$dir/server.log" >&2; exit 1; }
}

case "$cmd" in
  start)
    bin=$(find_bin) || { install_postgres; bin=$(find_bin); }
    if [ -f "$dir/port" ] && as_owner "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
      url
      exit 0
    fi
    rm -rf "$dir"
    (umask 077 && mkdir -p "$dir" && python3 -c 'import secrets; print(secrets.token_hex(24))' >"$dir/password")
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "$port" >"$dir/port"
    if [ "$(id -u)" = 0 ]; then
      id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
      chown -R postgres "$dir"
    fi
    as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=scram-sha-256 --pwfile="$dir/password" \
      --encoding=UTF8 --no-locale >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; exit 1; }
    launch
    # the password through the environment (not argv, which every local user can read in ps)
    PGPASSWORD=$(cat "$dir/password") as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres kvleague
    url
    ;;
  url)
    [ -f "$dir/port" ] || { echo "postgres.sh: no server in $dir" >&2; exit 1; }
    url
    ;;
  pause)  # stop the server but keep its data (fault tests: a database lost mid-sweep)
    bin=$(find_bin)
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null
    echo "postgres paused"
    ;;
  resume)  # start a paused server again, same data and port
    bin=$(find_bin)
    launch
    url
    ;;
  stop)
    if [ -d "$dir/data" ]; then
      bin=$(find_bin) || true
      [ -n "${bin:-}" ] && as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null 2>&1 || true
    fi
    rm -rf "$dir"
    echo "postgres stopped"
    ;;
  *)
    echo "usage: $0 start|url|pause|resume|stop [DIR]" >&2
    exit 2
    ;;
esac
