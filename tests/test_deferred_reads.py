"""An eviction that makes the host wait for nothing (``engine/deferred_reads.py``, issue 49).

A method that never scores -inf keeps exactly B, so its eviction's count is known on the host; its
checks (NaN, protected slots over B, a -inf score), ``ranked`` flag and keep masks' agreement are
read with the step's tokens. The oracle is the eager read path of the same engine (the method
declared ``keeps_fewer``, read before moving anything, as every eviction did before): the same
tokens, kept positions and counts, alone and batched, for methods scoring per token, per layer and
per head, ordered and order-free. Then the reads themselves, counted: one per greedy step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvleague.engine.contract import Needs
from kvleague.engine.deferred_reads import DeferredReads, post
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from kvleague.methods.knorm import KeyNorm

BUDGET = 12
PROTOCOLS = {
    "sinks": Protocol(sink=2, recent=3),
    "prompt kept": Protocol(protect_prompt=True, prompt_over_budget="keep", cadence="buffer=2", recent=2),
}
#: scores per token (knorm, epikv), per layer (lag_kv), per head (snapkv, h2o, tova); ordered and
#: order-free; each under one protocol (every method under both: the slab == hf tests' job)
CASES = [
    ("knorm", "prompt kept"),
    ("epikv", "sinks"),
    ("lag_kv", "prompt kept"),
    ("snapkv", "sinks"),
    ("h2o", "prompt kept"),
    ("tova", "sinks"),
]


def _read_eagerly(method):
    """``method`` with every eviction read before it moves anything (the path of a -inf method)."""
    method.needs = dataclasses.replace(method.needs, keeps_fewer=True)
    return method


def _same(oracle, result) -> None:
    assert result.token_ids == oracle.token_ids
    assert result.kept_positions == oracle.kept_positions
    for name in ("evictions", "evicted_tokens", "ranked_evictions", "peak_cache_entries"):
        assert getattr(result, name) == getattr(oracle, name), name


@pytest.mark.parametrize(("name", "protocol"), CASES)
def test_deferred_evictions_equal_the_eager_read_alone_and_batched(engines, prompt_ids, name, protocol):
    engine = engines["llama"]
    proto = PROTOCOLS[protocol]
    settings = GenerationSettings(max_new_tokens=14)
    prompts = [prompt_ids[:9], prompt_ids[3:23], prompt_ids[5:32]]
    deferred = [engine.generate(p, build_method(name), BUDGET, proto, settings) for p in prompts]
    eager = [engine.generate(p, _read_eagerly(build_method(name)), BUDGET, proto, settings) for p in prompts]
    for oracle, result in zip(eager, deferred):
        _same(oracle, result)
    assert sum(r.evictions for r in deferred) > 0
    assert sum(r.ranked_evictions for r in deferred) > 0
    batched = engine.generate_batch(prompts, [build_method(name) for _ in prompts], BUDGET, proto, settings)
    eager_batched = engine.generate_batch(
        prompts, [_read_eagerly(build_method(name)) for _ in prompts], BUDGET, proto, settings
    )
    for oracle, result in zip(eager_batched, batched):
        _same(oracle, result)


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_a_turn_s_pending_token_evicts_as_the_eager_read_does(engines, prompt_ids, name):
    """Multi-turn: the next turn first feeds the last decode's pending token through a one-step loop
    (``Session.flush_pending``), whose eviction is deferred too: what it posted is read before the
    loop is let go (its ranked count, per-head masks' agreement), as the eager read path counts."""
    engine = engines["llama"]

    def turns(method):
        with engine.session(method, BUDGET, Protocol(sink=1, recent=2)) as session:
            session.feed(prompt_ids[:20])
            session.decode(GenerationSettings(max_new_tokens=6))
            evictions = session.evictions
            session.flush_pending()
            assert session.evictions == evictions + 1  # the pending token's feed evicted
            session.feed(prompt_ids[20:26])
            session.decode(GenerationSettings(max_new_tokens=6))
            return session.result()

    _same(turns(_read_eagerly(build_method(name))), turns(build_method(name)))


def _at_once(values, then):
    """``post_floats`` as the methods read before: the values now."""
    then(values.to(torch.float64).cpu().numpy())


@pytest.mark.parametrize(
    ("name", "protocol"),
    [
        ("epikv", Protocol.preset("epikv_paper")),
        ("epikv_bands", Protocol(sink=2, recent=3)),
        ("hs_variance", Protocol(sink=1, recent=1, cadence="buffer=2")),
        ("kv_val", Protocol.preset("epikv_paper")),
        ("epikv", Protocol(sink=2)),  # no recent window: the new token's own eviction ranks it
        ("kv_key", Protocol(sink=2)),
        # its quotas rank the new token among the others (with no window of its own): it reads at once
        (
            ("epikv_seg", {"recent_window": 0, "segment": 4, "quotas": (2, 1, 0), "selection": "fill"}),
            Protocol(recent=3),
        ),
    ],
)
def test_scores_frozen_a_step_later_equal_those_frozen_at_once(engines, prompt_ids, name, protocol, monkeypatch):
    """The EpiKV family's and KV-key / KV-val's decode signals ride on the next step's token read, and
    their scores are read from the table's mirror (as on a GPU): the same tokens, kept positions and
    counts as reading the signals at once, alone and batched. Without a recent window the loop reads
    at once (a deferred read would rank the new token by the table's fill: the test then fails)."""
    from kvleague.methods import epikv, kernels, kv_variance

    engine = engines["llama"]
    name, params = name if isinstance(name, tuple) else (name, {})
    settings = GenerationSettings(max_new_tokens=14)
    prompts = [prompt_ids[:9], prompt_ids[3:23], prompt_ids[5:32]]
    budget = 16  # room for generated tokens beside the shortest prompt kept whole

    def run():
        alone = [engine.generate(p, build_method(name, params), budget, protocol, settings) for p in prompts]
        batch = [build_method(name, params) for _ in prompts]
        return alone, engine.generate_batch(prompts, batch, budget, protocol, settings)

    with monkeypatch.context() as patched:
        patched.setattr(kernels, "MIRROR_ON_CPU", True)
        deferred, deferred_batched = run()
    for module in (epikv, kv_variance):
        monkeypatch.setattr(module, "post_floats", _at_once)
    at_once, at_once_batched = run()
    for oracle, result in zip(at_once + at_once_batched, deferred + deferred_batched):
        _same(oracle, result)
    assert sum(r.ranked_evictions for r in deferred) > 0


def test_a_table_s_mirror_follows_its_writes():
    """``PositionTable.read`` from the mirror (a GPU's path) equals the host table after writes one by
    one, a bulk write and growth past the first 1,024 positions; ``fill`` where never written."""
    import numpy as np

    from kvleague.methods import kernels

    table = kernels.PositionTable(fill=float("inf"))
    ref = np.full(3000, float("inf"))
    rng = np.random.default_rng(0)
    positions = torch.arange(3000)
    for step, position in enumerate(rng.permutation(2500)[:400].tolist()):
        value = float(rng.normal())
        table.write_one(position, value)
        ref[position] = value
        if step % 37 == 0:  # a read between writes brings the mirror up to date
            kernels.MIRROR_ON_CPU = True
            try:
                assert table.read(positions, 2999).tolist() == ref.tolist()
                if step == 74:
                    bulk = torch.tensor([5, 1500, 2600])
                    table.write(bulk, torch.tensor([1.5, -2.0, 3.25]))
                    ref[bulk.numpy()] = [1.5, -2.0, 3.25]
            finally:
                kernels.MIRROR_ON_CPU = False
    assert table.read(positions, 2999).tolist() == ref.tolist()  # the host table itself
    kernels.MIRROR_ON_CPU = True
    try:
        assert table.read(positions, 2999).tolist() == ref.tolist()
    finally:
        kernels.MIRROR_ON_CPU = False


@pytest.fixture(scope="module")
def slab(tiny_models):
    """The slab backend (the GPU's path) over tiny llama, on its captured body's path."""
    from kvleague.runner.models import load_engine

    engine = load_engine(str(tiny_models["llama"]), backend="slab")
    engine.eos_ids = set()
    engine.backend.graphs = True
    return engine


@pytest.mark.parametrize(
    ("name", "batch"),
    [("full", 1), ("knorm", 4), ("snapkv", 1), ("h2o", 4), ("tova", 4), ("epikv", 1), ("epikv", 4), ("kv_key", 4)],
)
@pytest.mark.parametrize("reads", ["deferred", "eager"])
def test_a_greedy_step_reads_the_device_once(slab, prompt_ids, name, batch, reads, monkeypatch):
    """Every wait of the host on a device value while the sequences decode on the slab backend
    (``tolist``, ``item``, ``cpu``, ``nonzero``, ...): the tokens' read per step, and nothing else.
    The eager read path (the method declared ``keeps_fewer``) makes two or three per step: the
    eviction's counts, and per-head masks' agreement. As a GPU runs it: a batch's ordered eviction
    moves every kept slot (the CPU's shortcut reads where the first dropped one is), and frozen
    scores are read from their table's mirror on the device."""
    import kvleague.engine.cache_rows as cache_rows
    from kvleague.engine.decode import DecodeLoop
    from kvleague.methods import kernels
    from tests.host_syncs import HostSyncs

    monkeypatch.setattr(cache_rows, "first_dropped", lambda keep: 0)
    monkeypatch.setattr(kernels, "MIRROR_ON_CPU", True)
    steps = 12
    make = (lambda: build_method(name)) if reads == "deferred" else (lambda: _read_eagerly(build_method(name)))
    sessions = [slab.session(make(), BUDGET, Protocol(sink=2, recent=3)) for _ in range(batch)]
    for i, s in enumerate(sessions):
        with s:
            s.feed(prompt_ids[i : i + 20])
    loop = DecodeLoop(slab, sessions, GenerationSettings(max_new_tokens=steps))
    with HostSyncs() as spy:
        loop.run()
    # what makes the host wait (not a tensor built from host data, ``lift_fresh``: a copy to the device)
    waits = [where for op, where in spy.found if op != "aten.lift_fresh"]
    assert name == "full" or sessions[0].evictions >= steps - 1
    tokens = [w for w in waits if "deferred_reads.py" in w]
    assert len(tokens) == steps, waits  # each of the 12 tokens read once (the first from the prompt's logits)
    if reads == "deferred" or name == "full":
        assert waits == tokens
    else:
        assert len(waits) >= 2 * (steps - 1), waits


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_sampled_step_reads_the_device_once(slab, prompt_ids, top_p, monkeypatch):
    """Sampled decoding of a batch of 4 (each row its own generator): every row's token is drawn on
    the device and the batch's are read in one copy, with what the evictions posted: one wait per
    step (a row's own read made one per row). The tokens are each sequence's alone (its seed)."""
    import kvleague.engine.cache_rows as cache_rows
    from kvleague.engine.decode import DecodeLoop
    from tests.host_syncs import HostSyncs

    monkeypatch.setattr(cache_rows, "first_dropped", lambda keep: 0)
    steps, settings = 10, GenerationSettings(max_new_tokens=10, temperature=0.8, top_p=top_p)
    sessions = [slab.session(build_method("h2o"), BUDGET, Protocol(sink=2, recent=3), seed=i) for i in range(4)]
    for i, s in enumerate(sessions):
        with s:
            s.feed(prompt_ids[i : i + 20])
    loop = DecodeLoop(slab, sessions, settings)
    with HostSyncs() as spy:
        loop.run()
    waits = [where for op, where in spy.found if op != "aten.lift_fresh"]
    assert len(waits) == steps and all("deferred_reads.py" in w for w in waits), waits
    for i, s in enumerate(sessions):
        alone = slab.generate(
            prompt_ids[i : i + 20], build_method("h2o"), BUDGET, Protocol(sink=2, recent=3), settings, seed=i
        )
        assert s.result().token_ids == alone.token_ids


class _OneByOne(KeyNorm):
    """knorm scoring each sequence of a batch through its own ``score`` (not knorm's vectorised one)."""

    @classmethod
    def score_batch(cls, methods, caches):
        return [m.score(view) for m, view in zip(methods, caches.views)]


class _NaNLate(_OneByOne):
    """knorm, with one NaN score from the fourth eviction on."""

    def reset(self, info):
        super().reset(info)
        self.calls = 0

    def score(self, cache):
        self.calls += 1
        scores = super().score(cache).clone()
        if self.calls > 3:
            scores[..., 1] = float("nan")
        return scores


class _MinusInfUndeclared(_OneByOne):
    """knorm asking to drop every slot but two (-inf) without declaring ``keeps_fewer``."""

    def score(self, cache):
        scores = super().score(cache).clone()
        scores[..., 2:] = float("-inf")
        return scores


@pytest.mark.parametrize("batch", [1, 3])
def test_what_the_eviction_reads_later_is_still_refused(engines, prompt_ids, batch):
    """A NaN score found at a decode step, protected slots over the budget and an undeclared -inf
    are each refused in one line, alone and batched, though read a step later."""
    engine = engines["llama"]
    prompts = [prompt_ids[i : i + 20] for i in range(batch)]
    settings = GenerationSettings(max_new_tokens=12)

    def run(make, budget=BUDGET, protocol=None):
        engine.generate_batch(prompts, [make() for _ in prompts], budget, protocol or Protocol(), settings)

    with pytest.raises(KvleagueError, match="score: the method returned NaN scores"):
        run(_NaNLate)
    with pytest.raises(KvleagueError, match=r"declare Needs\(keeps_fewer=True\)"):
        run(_MinusInfUndeclared)
    # declared, the same scores keep fewer than B
    declared = type("Declared", (_MinusInfUndeclared,), {"needs": Needs(keeps_fewer=True)})
    result = engine.generate(prompts[0], declared(), BUDGET, Protocol(), settings)
    assert result.evictions > 0 and all(len(row) < BUDGET for row in result.kept_positions)
    # a 10-token prompt kept whole and a recent window of 3: 13 protected slots at the first eviction
    prompts = [p[:10] for p in prompts]
    with pytest.raises(KvleagueError, match="13 protected tokens"):
        run(lambda: build_method("knorm"), protocol=Protocol(protect_prompt=True, recent=3))


def test_posts_are_read_in_one_copy_with_the_read_the_host_makes(monkeypatch):
    """Three posts and a read: one ``tolist``, the callbacks in order with their own values; a post
    with none active is read at once."""
    calls = []
    real = torch.Tensor.tolist

    def counted(self):
        calls.append(self.numel())
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    reads = DeferredReads()
    got = []
    with reads.active():
        post(torch.tensor([1, 2]), lambda v: got.append(("a", v)))
        post(torch.tensor(True), lambda v: got.append(("b", v)))
    reads.post(torch.tensor([[7, 8], [9, 10]]), lambda v: got.append(("c", v)))
    assert reads.pending and got == [] and calls == []
    assert reads.read(torch.tensor([5, 6, 7])) == [5, 6, 7]
    assert calls == [3 + 2 + 1 + 4] and reads.reads == 1
    assert got == [("a", [1, 2]), ("b", [1]), ("c", [7, 8, 9, 10])]
    reads.flush()  # nothing posted: no read
    assert calls == [10]
    post(torch.tensor([4]), lambda v: got.append(("now", v)))
    assert got[-1] == ("now", [4]) and calls == [10, 1]


def test_every_copy_to_the_device_of_a_decode_step_goes_through_to_device():
    """On CUDA a copy from pageable host memory drains the stream (the host waits for every queued
    kernel): the modules a decode step runs build no device tensor from host data but through
    ``to_device`` (pinned, not blocking), which elsewhere is ``torch.tensor``."""
    import re
    from pathlib import Path

    from kvleague.engine.to_device import to_device

    root = Path(__file__).resolve().parents[1]
    hot = ["engine/decode.py", "engine/cache_rows.py", "engine/cache.py", "engine/contract.py", "engine/probe.py"]
    hot += ["engine/selection.py", "engine/compaction.py", "engine/slab.py", "engine/batch_invariance.py"]
    hot += ["engine/session.py"]  # a prompt's feed
    pattern = re.compile(r"torch\.(tensor|as_tensor)\([^()]*(\([^()]*\)[^()]*)*device=")
    found = [(p, m.group(0)) for p in hot for m in pattern.finditer((root / p).read_text())]
    assert not found, found
    assert pattern.search("x = torch.tensor([a, f(b)], device=d)")  # the check sees one
    made = to_device([[1, 2], [3, 4]], "cpu")
    assert made.tolist() == [[1, 2], [3, 4]] and made.dtype == torch.long
    assert to_device([0.5], torch.device("cpu"), torch.float64).dtype == torch.float64
    scores = torch.tensor([0.25, -1.0])  # a tensor made on the host: the same values, on the device
    assert to_device(scores, "cpu") is scores and to_device(scores, "cpu", torch.float64).tolist() == [0.25, -1.0]
    assert (
        re.search(
            r"\.to\((self|first)\.device\)",
            (root / "engine/cache.py").read_text() + (root / "engine/cache_rows.py").read_text(),
        )
        is None
    )
