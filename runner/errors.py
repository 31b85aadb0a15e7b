"""Errors that reach the user as one line (CLI exit code 2), never as a traceback."""


class KvleagueError(Exception):
    """Bad input or an impossible request; the message names the field and the allowed values."""
