"""Errors that reach the user as one line (CLI exit code 2), never as a traceback."""

import argparse


class KvleagueError(Exception):
    """Bad input or an impossible request; the message names the field and the allowed values."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are a KvleagueError (one line, exit code 2), not argparse's usage over several lines.
    Here, on the ground floor, so that every command line (``kvleague``, ``python -m kvleague.dashboard.browser``)
    shares it whatever layer it sits in."""

    def error(self, message: str) -> None:
        raise KvleagueError(f"{self.prog}: {message}")
