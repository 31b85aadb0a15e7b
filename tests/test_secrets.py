"""Credentials (issue 45): the database password never enters a command line and every file that holds
it is created 0600; the throwaway PostgreSQL server asks every connection for a password and its socket
is its owner's alone."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import yaml

from tests.conftest import REPO


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_cluster_set_up_keeps_the_password_out_of_argv_and_its_files_0600(tmp_path):
    """Run ray_cluster.yaml's head set-up under a permissive umask with stand-ins for sudo and kvleague
    that record their command lines (apt-get skipped): the generated password is in no recorded argv,
    and both files holding it are mode 0600."""
    commands = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())["head_setup_commands"]
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    log = tmp_path / "argv.log"
    for name in ("sudo", "kvleague"):  # each writes its argv; psql reads the password from stdin, unrecorded
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\ncat >/dev/null\n')
        (bin_dir / name).chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for command in commands:
        if "apt-get" in command:
            continue
        subprocess.run(["bash", "-c", f"umask 022; {command}"], env=env, check=True, stdin=subprocess.DEVNULL)
    password = (home / ".kvleague_pg_password").read_text().strip()
    assert len(password) >= 32
    assert password in (home / ".kvleague_env").read_text()
    assert _mode(home / ".kvleague_pg_password") == 0o600 and _mode(home / ".kvleague_env") == 0o600
    recorded = log.read_text()
    assert "sudo -u postgres psql -q" in recorded  # the role was (pretend-)created, through stdin
    assert password not in recorded


def test_the_test_server_asks_for_a_password_and_its_socket_is_private(pg_server):
    """scripts/postgres.sh's server (or $KVLEAGUE_PG_URL's): its URL carries a password, a connection
    without it is refused (no trust authentication, by TCP or by socket), and the socket is 0700."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(pg_server)
    assert url.password, "the server's URL carries no password"
    libpq = url.set(drivername="postgresql")
    with psycopg.connect(libpq.render_as_string(hide_password=False), connect_timeout=10) as conn:
        sockets = conn.execute("SHOW unix_socket_directories").fetchone()[0].split(",")
        permissions = conn.execute("SHOW unix_socket_permissions").fetchone()[0]
    assert permissions == "0700"
    for host in ["127.0.0.1", *(s.strip() for s in sockets if os.path.isdir(s.strip()))]:
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(
                host=host,
                port=url.port,
                user=url.username,
                dbname=url.database,
                connect_timeout=10,
                passfile="/dev/null",
            )
    for directory in (s.strip() for s in sockets):
        if os.path.isdir(directory) and directory != "/tmp":
            assert _mode(directory) == 0o700
