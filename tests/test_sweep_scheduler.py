"""The scheduler's hand-out of groups to workers, driven by a simulated Ray (no processes): a step of
simulated time per ``ray.wait``, each actor running its calls one at a time in the order sent."""

from __future__ import annotations

import random
import sys
import types

import pytest

from kvleague.runner.sweep_config import ResourcesConfig
from kvleague.runner.sweeping.scheduler import Scheduler


class Ref:
    def __init__(self, actor, group):
        self.actor, self.group = actor, group
        self.ready, self.cancelled = group is None, False


class FakeActor:
    """Runs its calls in order; a group of cells takes the sum of their ``steps``."""

    def __init__(self, ray):
        self.ray, self.calls, self.progress, self.ran = ray, [], 0, []
        self.run_group = types.SimpleNamespace(remote=self.submit)
        self.ping = types.SimpleNamespace(remote=lambda: Ref(self, None))

    def submit(self, group, batch_size="auto"):
        ref = Ref(self, group)
        self.calls.append(ref)
        return ref

    def step(self):
        if self.calls:
            self.progress += 1
            head = self.calls[0]
            if self.progress >= sum(c.steps for c in head.group):
                self.calls.pop(0)
                self.progress, head.ready = 0, True
                self.ran.append([c.key for c in head.group])


class FakeRay(types.ModuleType):
    def __init__(self, cells_total):
        super().__init__("ray")
        self.actors, self.cells_total, self.recorded, self.violations = [], cells_total, set(), []
        self.exceptions = types.SimpleNamespace(
            RayActorError=type("RayActorError", (Exception,), {}), RayTaskError=type("RayTaskError", (Exception,), {})
        )

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.ready]
        if ready or timeout == 0:  # already done (or cancelled), or a poll: no time passes
            return ready, [r for r in refs if not r.ready]
        self.check()
        for actor in self.actors:
            actor.step()
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    def check(self):
        """Before time passes: no actor idle while another has a call waiting or cells wait unsent."""
        held = {c.key for a in self.actors for r in a.calls for c in r.group}
        unsent = self.cells_total - len(self.recorded) - len(held)
        waiting = any(len(a.calls) > 1 for a in self.actors)
        idle = [i for i, a in enumerate(self.actors) if not a.calls]
        if idle and (waiting or unsent):
            self.violations.append((idle, [len(a.calls) for a in self.actors], unsent))

    def get(self, ref):
        assert not ref.cancelled, "a cancelled call's outcome was read"
        return [{"cell_key": c.key, "status": "ok"} for c in ref.group]

    def cancel(self, ref):
        assert ref in ref.actor.calls[1:], "cancelled a call that is running"
        ref.actor.calls.remove(ref)  # Ray skips it when the actor gets to it: no time spent
        ref.cancelled = True

    def kill(self, actor, no_restart=True):
        pass


def run_sweep(monkeypatch, steps: list[list[int]], workers: int, in_flight: int):
    """Groups of cells with the given step counts, on ``workers`` simulated actors; (ray, rows recorded)."""
    groups = [
        [types.SimpleNamespace(key=f"g{g}c{i}", steps=s, attempts=0, measure="generation") for i, s in enumerate(group)]
        for g, group in enumerate(steps)
    ]
    ray = FakeRay(sum(len(g) for g in groups))
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.exceptions", ray.exceptions)
    scheduler = Scheduler(ResourcesConfig(workers=workers, in_flight_per_worker=in_flight, cell_timeout_seconds=None))
    monkeypatch.setattr(scheduler, "init_ray", lambda: None)
    monkeypatch.setattr(scheduler, "plan_workers", lambda pending: (min(workers, pending), 1.0, 0.0))
    monkeypatch.setattr(scheduler, "actor_options", lambda cpus, gpus: {})

    def new_actor():
        actor = FakeActor(ray)
        ray.actors.append(actor)
        return actor

    monkeypatch.setattr(scheduler, "new_actor", new_actor)
    rows = []

    def record(cell, row):
        assert cell.key not in ray.recorded, f"{cell.key} recorded twice"
        ray.recorded.add(cell.key)
        rows.append(row)

    scheduler.run(groups, record, lambda: None)
    return ray, rows


def test_two_groups_on_two_workers_run_side_by_side(monkeypatch):
    """The issue's case: 2 groups, 2 workers, 2 calls in flight each: one group per worker, not both on the first."""
    ray, rows = run_sweep(monkeypatch, [[3], [3]], workers=2, in_flight=2)
    assert [len(a.ran) for a in ray.actors] == [1, 1]
    assert ray.violations == []
    assert len(rows) == 2


@pytest.mark.parametrize("seed", range(6))
def test_no_worker_idles_while_another_has_a_queue(monkeypatch, seed):
    """Uneven groups on 3 workers with calls pipelined 3 deep: a worker that runs dry takes a group still
    waiting behind another's (its call cancelled there), and every cell runs and is recorded once."""
    rng = random.Random(seed)
    steps = [[rng.choice([1, 1, 2, 8, 20]) for _ in range(rng.randint(1, 3))] for _ in range(11)]
    ray, rows = run_sweep(monkeypatch, steps, workers=3, in_flight=3)
    assert ray.violations == []
    assert sorted(r["cell_key"] for r in rows) == sorted(
        f"g{g}c{i}" for g, group in enumerate(steps) for i in range(len(group))
    )
    ran = [key for a in ray.actors for group in a.ran for key in group]
    assert sorted(ran) == sorted(r["cell_key"] for r in rows)  # no group ran twice


def test_a_queued_group_is_split_back_so_that_workers_do_not_idle(monkeypatch):
    """One plain generation group of 40 cells (four batches queued, continuous batching) on four
    workers: split back at batch boundaries (``auto``: 16), so three workers share it, not one."""
    ray, rows = run_sweep(monkeypatch, [[1] * 40], workers=4, in_flight=1)
    assert sorted(len(call) for a in ray.actors for call in a.ran) == [8, 16, 16]
    assert len(ray.actors) == 3 and all(len(a.ran) == 1 for a in ray.actors)
    assert len(rows) == 40 and not ray.violations
