"""The one hash of a specification: SHA-256 of its canonical JSON (sorted keys, anything JSON cannot
encode as its ``str``).

Cell keys and dimension rows (sweeps) use compact separators. The sweep's ``config_hash``, the
environment rows, benchmark and seeded rows were first stored with ``json.dumps``'s default
separators (``", "``, ``": "``): ``spaced=True`` keeps those stored hashes matching (``kvleague db
import`` matches sweeps by ``config_hash``; results/*.jsonl.gz hold environment hashes).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any, *, spaced: bool = False) -> str:
    return json.dumps(value, sort_keys=True, separators=None if spaced else (",", ":"), default=str)


def spec_hash(value: Any, *, spaced: bool = False) -> str:
    return hashlib.sha256(canonical_json(value, spaced=spaced).encode()).hexdigest()
