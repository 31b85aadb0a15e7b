"""Every column a benchmark prints has a one-line key under its table, and the profiler's own log
lines stay out of ``bench busy``'s output (issue 50)."""

from __future__ import annotations

import pytest

from kvleague.runner.bench import decode_speed, device_busy, harness, refill, vs_kvpress


@pytest.mark.parametrize("bench", [vs_kvpress, decode_speed, refill, device_busy], ids=lambda m: m.__name__)
def test_every_printed_column_has_a_key(bench):
    headers = [header for _, header, _ in bench.COLUMNS]
    keyed = [h for names in bench.KEY for h in names.split(", ")]
    assert sorted(keyed) == sorted(h for h in headers if h != "method")  # each once, none stale
    printed = harness.table([{}], bench.COLUMNS, bench.KEY).splitlines()
    assert printed[0].split()[0] == "method" and len(printed) == 3 + len(bench.KEY)
    assert all(line.startswith("  ") and ": " in line for line in printed[3:])


def test_profiler_log_lines_are_dropped(capfd):
    """kineto writes them to fd 2 from C++ at each start and stop; other lines written meanwhile stay."""
    import os

    import torch
    from torch.profiler import profile

    def profiled():
        with profile():
            torch.ones(2) + 1
        os.write(2, b"a line of the run\n")

    profiled()
    assert "USDT" in capfd.readouterr().err  # the oracle: torch prints them
    with device_busy.profiler_lines_dropped():
        profiled()
    err = capfd.readouterr().err
    assert "USDT" not in err and "STAGE" not in err and "a line of the run\n" in err
