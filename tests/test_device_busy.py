"""``kvleague bench busy``: the profiler window's arithmetic against hand-computed figures on
synthetic events, the interval union against a brute-force count, and one real run on the CPU
(where the device's share is not measured and must say so)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from kvleague.runner.bench.device_busy import MARK, analyse, union_length


def test_union_length_counts_overlaps_once():
    rng = random.Random(0)
    for _ in range(200):
        intervals = []
        for _ in range(rng.randint(0, 8)):
            a = rng.randint(0, 50)
            intervals.append((a, a + rng.randint(0, 20)))
        covered = {t for a, b in intervals for t in range(a, b)}  # unit cells [t, t + 1)
        assert union_length(intervals) == len(covered)


def _event(name, start, end, device=DeviceType.CPU, parent=None):
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, cpu_parent=parent
    )


def test_the_window_skips_warmup_steps_and_counts_what_lies_inside():
    steps = [_event(MARK, 0, 100), _event(MARK, 100, 200), _event(MARK, 200, 300), _event(MARK, 300, 400)]
    linear = _event("aten::linear", 120, 150, parent=steps[1])
    events = steps + [
        _event("aten::mm", 10, 20, parent=steps[0]),  # a warm-up step's op: outside the window
        linear,
        _event("aten::addmm", 125, 145, parent=linear),  # nested: counted once, as linear
        _event("aten::cat", 310, 320, parent=steps[3]),
        _event("aten::argmax", 390, 395),  # the loop's own read, between marks: inside the window
        _event("gemm_kernel", 130, 170, DeviceType.CUDA),
        _event("gemm_kernel", 160, 190, DeviceType.CUDA),
        _event("cat_kernel", 330, 340, DeviceType.CUDA),
        _event("early_kernel", 20, 40, DeviceType.CUDA),  # before the window
    ]
    got = analyse(events, batch=4, warmup=1)
    # window [100, 400]: device busy over [130, 190] and [330, 340] = 70 of 300; 3 kernels for 3 steps x 4 rows
    assert got == {
        "steps": 3,
        "device_busy": pytest.approx(70 / 300),
        "kernels_per_token": pytest.approx(3 / 12),
        "host_ops_per_step": pytest.approx(3 / 3),
        "step_ms": pytest.approx(300 / 3 / 1e3),
    }
    cpu_only = [e for e in events if e.device_type == DeviceType.CPU]
    assert analyse(cpu_only, batch=4, warmup=1)["device_busy"] is None  # no device: not measured, not 0
    assert analyse(steps[:1], batch=4, warmup=1) == {"steps": 0}


def test_bench_busy_reports_each_method_batch_and_backend(tiny_models, tmp_path):
    from kvleague.cli import main
    from kvleague.engine.decode import DecodeLoop

    step = DecodeLoop.step
    out = tmp_path / "busy.json"  # the name the GPU check gives it
    assert (
        main(
            [
                "bench",
                "busy",
                "--quick",
                "--model",
                str(tiny_models["llama"]),
                "--methods",
                "full,snapkv",
                "--batch-sizes",
                "1,3",
                "--steps",
                "3",
                "--warmup",
                "2",
                "--backend",
                "hf",
                "--backend",
                "slab",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert DecodeLoop.step is step  # the marking is undone
    report = json.loads(out.read_text())
    rows = {(r["backend"], r["method"], r["batch_size"]): r for r in report["rows"]}
    assert set(rows) == {(b, m, n) for b in ("hf", "slab") for m in ("full", "snapkv") for n in (1, 3)}
    for row in rows.values():
        assert row["steps"] == 3 and row["device_busy"] is None and row["kernels_per_token"] is None
        assert row["host_ops_per_step"] > 0 and row["step_ms"] > 0
    # the GPU check's table shows the profile beside the targets
    assert main(["bench", "targets", str(tmp_path)]) == 0
    text = (tmp_path / "targets.md").read_text()
    assert text.count("| not measured | not measured |") == 8 and "| slab | snapkv | 3 |" in text
    # the attention-reading method dispatches more per step than the full cache, at both sizes
    for b in ("hf", "slab"):
        for n in (1, 3):
            assert rows[(b, "snapkv", n)]["host_ops_per_step"] > rows[(b, "full", n)]["host_ops_per_step"]
