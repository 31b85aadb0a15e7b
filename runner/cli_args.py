"""What every command group of the CLI shares: the one-line parser (from ``engine.errors``), ``NAME=VALUE``
options, and the protocol: ``--protocol PRESET`` or one flag per field of
:class:`engine.protocol.Protocol` (``--sink``, ``--prefill-chunk``, ...), made from the field
list, the same in every command that runs a method."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from kvleague.engine.errors import KvleagueError, OneLineParser  # noqa: F401 - the commands import it from here
from kvleague.engine.protocol import PRESETS, Protocol, protocol_fields


def parse_assignment(text: str, flag: str) -> tuple[str, Any]:
    """``NAME=VALUE`` given to ``flag``, the value read as a YAML scalar (``3`` -> int, ``0.5`` -> float,
    ``true`` -> bool, ``[1, 2]`` -> list, ``null``; else the string)."""
    if "=" not in text:
        raise KvleagueError(f"{flag}: expected NAME=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value else value
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """``--protocol PRESET`` and a flag per protocol field; default None (not given): the field's own
    default applies, and a preset can tell a flag was given."""
    parser.add_argument(
        "--protocol",
        default=None,
        metavar="PRESET",
        help=f"a named protocol ({', '.join(PRESETS)}): every protocol field at once, so no other protocol flag",
    )
    for f in protocol_fields():
        if f.switch:
            parser.add_argument(_flag(f.name), action="store_true", help=f.help)
        else:
            parser.add_argument(
                _flag(f.name),
                default=None,
                type=f.parse,
                help=f.help,
                choices=list(f.choices) if f.choices else None,
            )


def protocol_from_args(args: argparse.Namespace) -> Protocol:
    """The Protocol the flags describe: the preset when ``--protocol`` is given (then any other protocol
    flag is an error), else Protocol's defaults with the flags given on top."""
    given = {f.name: _flag(f.name) for f in protocol_fields() if getattr(args, f.name) not in (None, False)}
    if args.protocol:
        if given:
            raise KvleagueError(
                f"--protocol: the preset {args.protocol} sets every protocol field; drop {', '.join(given.values())}"
            )
        try:
            return Protocol.preset(args.protocol)
        except KvleagueError as exc:
            raise KvleagueError(f"--{exc}") from None
    return Protocol(**{name: getattr(args, name) for name in given})
