"""What Ray prints on a sweep's driver, kept to what its user needs (issue 50).

* Calls the sweep abandons on purpose (Ctrl-C, the calls queued on a worker it replaced) end in errors
  nobody reads; Ray prints each as an "Unhandled error ... killed by `ray.kill`" after kvleague's own
  message. ``RAY_IGNORE_UNHANDLED_ERRORS`` (Ray's documented switch) silences them; the errors the sweep
  needs it reads with ``ray.get``.
* Ray's memory monitor, when it kills a worker, sends the driver a screen of text (the node's memory,
  its ten largest processes, advice). It becomes one line: the worker, the memory, and that its cells
  are retried; the scheduler then prints one line per cell it runs again.
"""

from __future__ import annotations

import os
import re
import sys

#: the memory monitor's report (Ray's raylet: "N worker(s) were killed due to the node running low on
#: memory", "Memory on the node (IP: ..., ID: ...) was X GB used / Y GB limit")
KILLED = re.compile(
    r"(\d+) worker\(s\) were killed due to the node running low on memory|Task was killed due to the node running low on memory"
)
MEMORY = re.compile(r"Memory on the node \(IP: ([^,]+), ID: [^)]*\)[^.]*? was ([\d.]+) ?GB(?: used)? / ([\d.]+) ?GB")
PID = re.compile(r"pid=(\d+)")


def quiet_unhandled_errors() -> None:
    """Before ``ray.init``: no "Unhandled error" lines for calls the sweep abandoned (read at each one)."""
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")


def condense(message: str) -> str | None:
    """One line for the memory monitor's report of a worker it killed; None for any other message."""
    if not KILLED.search(message):
        return None
    memory = MEMORY.search(message)
    pid = PID.search(message)
    where = f" (node {memory.group(1)}: {memory.group(2)} of {memory.group(3)} GB used)" if memory else ""
    who = f"worker pid {pid.group(1)}" if pid else "a worker"
    return f"ray: {who} killed for memory{where}; its cells are retried (resources.memory_limit_gb bounds a worker)"


def install() -> None:
    """After ``ray.init``: Ray's driver prints the raylet's messages through this module's filter."""
    from ray._private import worker

    original = getattr(worker.print_to_stdstream, "__wrapped__", worker.print_to_stdstream)

    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") == "raylet":
            line = condense("\n".join(data.get("lines") or []))
            if line is not None:
                print(line, file=sys.stderr, flush=True)
                return
        original(data, ignore_prefix)

    print_to_stdstream.__wrapped__ = original  # type: ignore[attr-defined]
    worker.print_to_stdstream = print_to_stdstream
