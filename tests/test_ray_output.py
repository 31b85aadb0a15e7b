"""What Ray prints on a sweep's driver (issue 50): its memory monitor's screen of text is one line, and
the errors of calls the sweep abandons (Ctrl-C, a replaced worker's queue) print nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvleague.runner.sweeping import ray_output

# the raylet's report, in its own words (its format strings, filled in as a 135M-model sweep saw it)
OOM = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.5, "
    "ID: 5f3c) was 7.30GB used / 7.70GB limit (0.948052), which exceeds the memory usage threshold of 0.95. "
    "Ray killed this worker (ID: 91ab) because it was the most recently scheduled task; to see more "
    "information about memory usage on this node, use `ray logs raylet.out -ip 10.0.0.5`.\n"
    "Top 10 memory users:\nPID\tMEM(GB)\tCOMMAND\n4242\t3.10\tray::CellWorker.run_group (pid=4242)\n"
    + "".join(f"{4243 + i}\t0.{i}0\tray::IDLE\n" for i in range(9))
    + "Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/..."
)


def test_the_memory_monitors_report_is_one_line():
    line = ray_output.condense(OOM)
    assert line == (
        "ray: worker pid 4242 killed for memory (node 10.0.0.5: 7.30 of 7.70 GB used); its cells are retried "
        "(resources.memory_limit_gb bounds a worker)"
    )
    assert ray_output.condense("The autoscaler failed to add nodes") is None


def test_the_driver_prints_it_through_the_filter(monkeypatch, capsys):
    from ray._private import worker

    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # restored afterwards
    ray_output.install()
    ray_output.install()  # twice (a second sweep in one process) wraps Ray's function once
    worker.print_to_stdstream({"lines": OOM.splitlines(), "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ray: worker pid 4242 killed for memory")
    worker.print_to_stdstream({"lines": ["something else"], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert "something else" in capsys.readouterr().out  # Ray's own printing, unchanged


@pytest.mark.parametrize("quiet", [False, True])
def test_abandoned_calls_errors_print_nothing(monkeypatch, caplog, quiet):
    """Ray reports an error nobody read when its reference goes; with the sweep's setting it does not."""
    from ray._private import worker

    monkeypatch.delenv("RAY_IGNORE_UNHANDLED_ERRORS", raising=False)
    if quiet:
        ray_output.quiet_unhandled_errors()
    killed = RuntimeError("The actor is dead because it was killed by `ray.kill`.")
    stand_in = SimpleNamespace(deserialize_objects=lambda objects, refs: [killed])
    with caplog.at_level(logging.ERROR):
        worker.Worker.raise_errors(stand_in, [object()], [object()])
    assert ("killed by `ray.kill`" in caplog.text) == (not quiet)
