"""Batched generation (``Engine.generate_batch``) against the single-sequence engine, the oracle.

Every built-in method on tiny llama / qwen2 / qwen3 in float64: each sequence of a batch of 8
prompts of different lengths must produce the same tokens, kept positions and eviction counts as
``Engine.generate`` gives it alone. Each architecture runs under a different protocol, so sinks,
the recent window, prompt protection (kept whole beyond B), ``positions: compact``, a buffered
cadence, chunked prefill and seeded sampling are all exercised per sequence.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
import torch

from kvleague.engine.batch import auto_batch_size
from kvleague.engine.contract import CacheView, EvictionMethod, Needs
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import available_methods, build_method
from kvleague.methods.kernels import PositionTable
from kvleague.methods.knorm import KeyNorm
from tests.conftest import ARCHS
from tests.test_engine import Recorder

METHODS = sorted(available_methods())
BUDGET = 16
NEW_TOKENS = 12
LENGTHS = (5, 8, 11, 14, 17, 20, 24, 28)  # below, at and above the budget
PROTOCOLS = {
    "llama": Protocol(sink=2, recent=3),
    # the prompt is kept whole even beyond B: long prompts drop every generated token at once
    "qwen2": Protocol(
        positions="compact", cadence="buffer=3", recent=2, protect_prompt=True, prompt_over_budget="keep"
    ),
    "qwen3": Protocol(sink=1, prefill_chunk=7),
}
SETTINGS = {
    "llama": GenerationSettings(max_new_tokens=NEW_TOKENS),
    "qwen2": GenerationSettings(max_new_tokens=NEW_TOKENS),
    "qwen3": GenerationSettings(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9),  # per-sequence generators
}


@pytest.fixture(scope="module")
def engines64(tiny_models):
    from kvleague.runner.models import load_engine

    torch.set_num_threads(1)
    out = {}
    for arch, path in tiny_models.items():
        engine = load_engine(str(path))
        engine.model.double()
        engine.eos_ids = set()  # every sequence decodes NEW_TOKENS: the stop test below sets its own
        out[arch] = engine
    return out


@pytest.fixture(scope="module")
def prompts(engines64) -> list[list[int]]:
    text = "Once the cache is full, every new token costs an old one; which one goes is the whole question. " * 2
    ids = engines64["llama"].tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[3 * i : 3 * i + n] for i, n in enumerate(LENGTHS)]


def _same(single, batched) -> None:
    assert batched.token_ids == single.token_ids
    assert batched.kept_positions == single.kept_positions
    for name in (
        "evictions",
        "evicted_tokens",
        "peak_cache_entries",
        "prompt_tokens",
        "generated_tokens",
        "stop_reason",
        "completion",
        "attn_implementation",
        "method",
        "params",
        "budget",
    ):
        assert getattr(batched, name) == getattr(single, name), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", METHODS)
def test_each_sequence_of_a_batch_equals_it_alone(engines64, prompts, name, arch, monkeypatch):
    """Rows evict alone while their lengths differ and in one selection once they agree
    (``cache_rows.evict_rows``; under qwen2's protocol the kept prompts differ, so they always evict alone)."""
    import kvleague.engine.decode as decode

    together = []
    evict_rows = decode.evict_rows
    monkeypatch.setattr(decode, "evict_rows", lambda *a, **k: together.append(evict_rows(*a, **k)) or together[-1])
    engine, protocol, settings = engines64[arch], PROTOCOLS[arch], SETTINGS[arch]
    seeds = list(range(10, 10 + len(prompts)))
    alone = [engine.generate(p, build_method(name), BUDGET, protocol, settings, seed=s) for p, s in zip(prompts, seeds)]
    batched = engine.generate_batch(prompts, [build_method(name) for _ in prompts], BUDGET, protocol, settings, seeds)
    assert len(batched) == len(prompts)
    for single, result in zip(alone, batched):
        _same(single, result)
    if not build_method(name).never_evicts:  # sequences evict from different steps on (the shortest never)
        evictions = [r.evictions for r in alone]
        assert sum(e > 0 for e in evictions) >= 6 and len(set(evictions)) > 3
        assert sum(x is not None for x in together) >= (0 if arch == "qwen2" else 5)


#: the built-ins that vectorise: (observe_batch, score_batch) replace per-sequence calls on equal-length rows
#: (the EpiKV family's and KV-key / KV-val's scores are one read on the device per row: no batched path)
VECTORISED = {
    "epikv": ("observe",),
    "epikv_bands": ("observe",),
    "hs_variance": ("observe",),
    "h2o": ("observe", "score"),
    "tova": ("observe",),
    "knorm": ("score",),
    "keydiff": ("score",),
    "streaming_llm": ("score",),
    "snapkv": ("observe", "score"),
    "rkv": ("observe", "score"),
    "scissorhands": ("observe", "score"),
    "kv_key": ("observe",),
    "kv_val": ("observe",),
    "raas": ("observe", "score"),
    "lazy_eviction": ("observe", "score"),
    "thinkv": ("observe", "score"),
    "lag_kv": ("score",),
    "lag_kv_key": ("score",),
    "epikv_seg": ("observe", "score"),
    "thinkv_authors": ("observe", "score"),
    "h2o_authors": ("observe", "score"),
    "raas_authors": ("observe", "score"),
    "longflow_authors": ("observe", "score"),
    "rkv_authors": ("observe",),
}
#: variants whose vectorised path has arithmetic of its own: ``name:hyperparameter=value``
VARIANTS = {
    "epikv:arithmetic=float64": ("epikv", {"arithmetic": "float64"}),
    "hs_variance:arithmetic=float64": ("hs_variance", {"arithmetic": "float64"}),
    # chunks short enough that the cache holds several, and a partial one
    "lag_kv:lag=4": ("lag_kv", {"lag": 4}),
    "lag_kv:arithmetic=float32,lag=5": ("lag_kv", {"arithmetic": "float32", "lag": 5}),
    "lag_kv_key:lag=3": ("lag_kv_key", {"lag": 3}),
    "epikv_seg:segment=3": ("epikv_seg", {"segment": 3, "quotas": (2, 1, 0), "recent_window": 2}),
    # a window short enough that the accumulated attention chooses (the default keeps sinks + window)
    "h2o_authors:recent=2": ("h2o_authors", {"recent": 2}),
    # query windows that fill while decoding, so a batch's windows shift together
    "snapkv:window=4": ("snapkv", {"window": 4}),
    "scissorhands:history=4": ("scissorhands", {"history": 4}),
}
#: (prompt tokens, budget, new tokens) where the default (14, 12, 10) would not reach the path: EpiKV-Seg's
#: quotas fill only the budget a short prompt leaves, over several segments of generated tokens
SETUPS = {"epikv_seg:segment=3": (5, 14, 24)}


@pytest.mark.parametrize("case", sorted(VECTORISED) + sorted(VARIANTS))
def test_vectorised_methods_run_batched_and_equal_each_sequence_alone(engines64, prompts, case):
    """Equal-length prompts (different tokens) put every row at B together: the vectorised paths run
    (no per-sequence ``observe`` / ``score`` call while decoding) and still match the oracle."""
    _batched_equals_alone(engines64, prompts, case)


@pytest.mark.parametrize(
    "case",
    [
        "snapkv:window=4",
        "scissorhands:history=4",
        "rkv",
        "keydiff",
        "lag_kv:lag=4",
        "lag_kv_key:lag=3",
        "thinkv",
        "tova",
    ],
)
def test_layers_and_rows_taken_a_few_at_a_time_equal_each_sequence_alone(engines64, prompts, case, monkeypatch):
    """Under a memory cap that admits one layer (one row) at a time, the batched arithmetic that stacks
    layers (the window's attention, the newest query's rows under SDPA, R-KV's redundancy, KeyDiff's
    similarity) or rows (LagKV) runs in
    several chunks and still equals each sequence alone (ThinKV's accumulated attention bit for bit)."""
    from kvleague.engine import contract, probe
    from kvleague.methods import kernels

    sizes = []
    chunks = contract.chunks
    monkeypatch.setattr(contract, "STACK_BYTES", 1)

    def spy(count, each):
        sizes.append(count)
        return chunks(count, each)

    for module in (contract, kernels, probe, sys.modules[build_method(case.split(":")[0]).__module__]):
        monkeypatch.setattr(module, "chunks", spy, raising=False)
    _batched_equals_alone(engines64, prompts, case)
    assert sizes and all(size > 1 for size in sizes)


def _batched_equals_alone(engines64, prompts, case):
    name, params = VARIANTS.get(case, (case, {}))
    n_prompt, budget, new_tokens = SETUPS.get(case, (14, 12, 10))
    engine, protocol = engines64["llama"], Protocol(sink=1, recent=2)
    settings = GenerationSettings(max_new_tokens=new_tokens)
    same_length = [p[-n_prompt:] for p in prompts[4:]] + [list(reversed(p[-n_prompt:])) for p in prompts[4:]]
    own = [build_method(name, params) for _ in same_length]
    alone = [engine.generate(p, m, budget, protocol, settings) for p, m in zip(same_length, own)]
    methods = [build_method(name, params) for _ in same_length]
    calls = []
    for m in methods:
        for hook in VECTORISED[name]:
            original = getattr(m, hook)

            def spy(arg, original=original, hook=hook):
                if arg.phase == "decode":
                    calls.append(hook)
                return original(arg)

            setattr(m, hook, spy)
    batched = engine.generate_batch(same_length, methods, budget, protocol, settings)
    if case in SETUPS:  # rows that keep fewer than B part in length, and then a row may evict alone
        evictions = sum(r.evictions for r in batched)
        assert calls.count("score") <= evictions // 4 and "observe" not in calls, (calls, evictions)
    else:
        assert not calls, f"per-sequence {calls[0]} called: the vectorised path did not run"
    for single, result in zip(alone, batched):
        _same(single, result)
    for single, batch_member in zip(own, methods):  # per-position state: bit for bit, not only its ranking
        for name, table in vars(single).items():
            if isinstance(table, PositionTable):
                assert torch.equal(table.data, getattr(batch_member, name).data), name


def test_a_batch_mixes_methods_kernels_and_finishing_times(engines64, prompts, monkeypatch):
    """One batch, eight methods (eager h2o with SDPA ones), EOS ending sequences at different steps."""
    engine = engines64["llama"]
    names = ["h2o", "knorm", "epikv", "tova", "snapkv", "streaming_llm", "full", "keydiff"]
    protocol, settings = Protocol(sink=1, recent=2), GenerationSettings(max_new_tokens=24)
    free = [engine.generate(p, build_method(n), BUDGET, protocol, settings) for p, n in zip(prompts, names)]
    counts = torch.bincount(torch.tensor([t for r in free for t in r.token_ids[2:]]))
    monkeypatch.setattr(engine, "eos_ids", {int(counts.argmax())})  # the commonest token ends sequences early
    alone = [engine.generate(p, build_method(n), BUDGET, protocol, settings) for p, n in zip(prompts, names)]
    assert {r.stop_reason for r in alone} == {"eos", "length"} and len({r.generated_tokens for r in alone}) > 2
    batched = engine.generate_batch(prompts, [build_method(n) for n in names], BUDGET, protocol, settings, batch_size=8)
    for single, result in zip(alone, batched):
        _same(single, result)


def test_finished_rows_take_the_next_prompts(engines64, prompts, monkeypatch):
    """Continuous batching: seven prompts through three rows, EOS ending sequences at different steps;
    each finished row is taken by the next prompt (``DecodeLoop.refill``; ``full``, admitted into a
    batch of evicting rows, makes the slabs grow), and every sequence equals it alone."""
    import kvleague.engine.batch as batch

    engine = engines64["llama"]
    names = ["knorm", "epikv", "tova", "snapkv", "streaming_llm", "full", "keydiff"]
    protocol, settings = Protocol(sink=1, recent=2), GenerationSettings(max_new_tokens=24)
    free = [engine.generate(p, build_method(n), BUDGET, protocol, settings) for p, n in zip(prompts, names)]
    counts = torch.bincount(torch.tensor([t for r in free for t in r.token_ids[2:]]))
    monkeypatch.setattr(engine, "eos_ids", {int(counts.argmax())})  # the commonest token ends sequences early
    alone = [engine.generate(p, build_method(n), BUDGET, protocol, settings) for p, n in zip(prompts, names)]
    assert len({r.generated_tokens for r in alone}) > 3
    loops, admitted = [], []

    class Loop(batch.DecodeLoop):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            loops.append(len(self.sessions))

        def _admit(self):
            before = len(self.sessions)
            going = super()._admit()
            admitted.append(len(self.sessions) - before)
            return going

    monkeypatch.setattr(batch, "DecodeLoop", Loop)
    batched = engine.generate_batch(
        prompts[:7], [build_method(n) for n in names], BUDGET, protocol, settings, batch_size=3
    )
    for single, result in zip(alone, batched):
        _same(single, result)
    assert loops == [3] and sum(admitted) == 4  # one loop of three rows; the other four prompts took finished rows


def test_rows_of_one_method_apart_in_the_slab_evict_together(engines64, prompts, monkeypatch):
    """Equal-length rows, three methods interleaved (per-token, per-head and per-layer-head scores):
    each method's rows are not contiguous in the slab, and they still evict in one selection each
    (``evict_rows`` over gathered rows, written back), every row equal to its sequence alone."""
    import kvleague.engine.decode as decode

    together = []
    evict_rows = decode.evict_rows
    monkeypatch.setattr(
        decode, "evict_rows", lambda *a, **k: together.append((a[-1], evict_rows(*a, **k))) or together[-1][1]
    )
    engine, protocol, settings = engines64["llama"], Protocol(sink=1, recent=2), GenerationSettings(max_new_tokens=10)
    same_length = [p[-14:] for p in prompts[4:]] + [list(reversed(p[-14:])) for p in prompts[4:]]
    names = ["epikv", "knorm", "tova", "epikv", "knorm", "tova", "epikv", "knorm"]
    alone = [engine.generate(p, build_method(n), 12, protocol, settings) for p, n in zip(same_length, names)]
    batched = engine.generate_batch(same_length, [build_method(n) for n in names], 12, protocol, settings)
    for single, result in zip(alone, batched):
        _same(single, result)
    rows = {tuple(r) for r, dropped in together if dropped is not None}
    assert rows == {(0, 3, 6), (1, 4, 7), (2, 5)}


class _DropOddLate(EvictionMethod):
    """Scores by position, and after its first few evictions asks to drop every odd position (-inf)."""

    needs = Needs(keeps_fewer=True)

    def reset(self, info):
        super().reset(info)
        self.calls = 0

    def score(self, cache):
        self.calls += 1
        positions = cache.token_positions.double()
        return torch.where((positions.remainder(2) == 1) & (self.calls > 3), float("-inf"), positions)


@pytest.mark.parametrize("name", ["epikv", "h2o", "knorm", "streaming_llm", "drop_odd"])
def test_rows_with_their_own_budgets_and_lengths_evict_together(engines64, prompts, name, monkeypatch):
    """Budgets that differ per row (``prompt+4`` under the authors' preset, whose recent window is a
    quarter of each row's budget; absolute ones under another protocol), prompts of six lengths: the
    rows still evict in one selection, each as it would alone. A ``-inf`` score that leaves fewer
    slots than the budget is settled row by row (``evict_rows`` declines, nothing changed)."""
    import kvleague.engine.decode as decode
    from kvleague.engine.decode import DecodeLoop
    from kvleague.engine.session import Session

    together = []
    evict_rows = decode.evict_rows
    monkeypatch.setattr(decode, "evict_rows", lambda *a, **k: together.append(evict_rows(*a, **k)) or together[-1])
    engine, settings = engines64["llama"], GenerationSettings(max_new_tokens=10)
    make = (lambda: _DropOddLate()) if name == "drop_odd" else (lambda: build_method(name))
    chosen = prompts[1:7]  # 8 to 24 tokens
    if name in ("epikv", "h2o"):
        protocol, budgets = Protocol.preset("epikv_paper"), [len(p) + 4 for p in chosen]
    else:
        protocol, budgets = Protocol(sink=1, recent=2), [8 + 2 * i for i in range(len(chosen))]
    alone = [engine.generate(p, make(), b, protocol, settings) for p, b in zip(chosen, budgets)]
    sessions = [Session(engine, make(), b, protocol, 0) for b in budgets]
    for session, p in zip(sessions, chosen):
        with session:
            session.feed(p)
    DecodeLoop(engine, sessions, settings).run()
    for single, session in zip(alone, sessions):
        _same(single, session.result())
    if name == "drop_odd":
        assert None in together and any(x is not None for x in together)
        assert any(r.peak_cache_entries > len(r.kept_positions[0]) for r in alone)
    else:
        assert len(together) >= 4 and all(x is not None for x in together)


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("name", ["knorm", "streaming_llm", "tova", "random", "epikv", "h2o", "snapkv"])
def test_one_selection_leaves_every_row_slot_for_slot_as_evicting_alone(engines64, prompts, name, path, monkeypatch):
    """The batched selection against the per-row one on the same batch: after decoding, every row's
    K/V slots, positions and prompt flags are equal slot for slot (order-free methods refill holes
    from above the budget; ordered ones compact), not only as sets of kept positions. ``gpu``: the
    moves a GPU makes (every kept slot, not only those after the first dropped one), gathered one
    layer at a time (as the slabs of a large cache are)."""
    import kvleague.engine.cache_rows as cache_rows
    import kvleague.engine.compaction as compaction
    import kvleague.engine.decode as decode
    from kvleague.engine.decode import DecodeLoop
    from kvleague.engine.session import Session

    # a buffered cadence: each decode eviction drops several slots at once, so holes and donors pair up
    engine, settings = engines64["qwen3"], GenerationSettings(max_new_tokens=14)
    protocol = Protocol(sink=1, recent=2, cadence="buffer=3")
    chosen, budgets = prompts[2:8], [9, 12, 10, 15, 11, 13]

    def run(together: bool):
        if not together:
            monkeypatch.setattr(decode, "evict_rows", lambda *a, **k: None)
        elif path == "gpu":
            monkeypatch.setattr(cache_rows, "first_dropped", lambda keep: 0)
            monkeypatch.setattr(compaction, "GATHER_BYTES", 1)
        sessions = [Session(engine, build_method(name), b, protocol, 5) for b in budgets]
        for session, p in zip(sessions, chosen):
            with session:
                session.feed(p)
        DecodeLoop(engine, sessions, settings).run()
        monkeypatch.undo()
        return [
            (
                [layer.keys.clone() for layer in s.cache.cache.layers],
                [layer.values.clone() for layer in s.cache.cache.layers],
                torch.stack(s.cache.positions),
                torch.stack(s.cache.is_prompt),
                s.evictions,
            )
            for s in sessions
        ]

    for alone, batched in zip(run(False), run(True)):
        assert alone[4] == batched[4] > 0
        for a, b in zip(alone[:4], batched[:4]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


class _Copying(Recorder):
    """Keeps a copy of each observation (its tensors are the engine's, valid during ``observe`` only)."""

    def observe(self, obs) -> None:
        def copy(x):
            return [t.clone() for t in x] if isinstance(x, list) else x

        super().observe(type(obs)(**{k: copy(v) for k, v in vars(obs).items()}))


def test_batch_size_splits_and_observations_equal_the_single_ones(engines64, prompts):
    """A method that records what it observes sees the same tensors batched (attention rows, queries,
    new keys and values, hidden states), whatever batch it is in."""
    engine = engines64["qwen3"]
    protocol, settings = Protocol(sink=1), GenerationSettings(max_new_tokens=10)
    alone = []
    for p in prompts[:5]:
        method = _Copying()
        engine.generate(p, method, BUDGET, protocol, settings)
        alone.append(method.observations)
    methods = [_Copying() for _ in prompts[:5]]
    engine.generate_batch(prompts[:5], methods, BUDGET, protocol, settings, batch_size=3)  # batches of 3 and 2
    for single, method in zip(alone, methods):
        assert len(method.observations) == len(single)
        for a, b in zip(single, method.observations):
            assert (a.phase, a.new_positions.tolist(), a.new_token_ids.tolist()) == (
                b.phase,
                b.new_positions.tolist(),
                b.new_token_ids.tolist(),
            )
            for field in ("cache_positions", "new_keys", "new_values", "queries", "attention"):
                for x, y in zip(getattr(a, field), getattr(b, field)):
                    torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
            for layer in a.hidden_states:
                torch.testing.assert_close(b.hidden_states[layer], a.hidden_states[layer], rtol=1e-12, atol=1e-12)


@dataclass
class _PaddedKeyNorm(EvictionMethod):
    """Scores from ``BatchCacheView.keys`` (the padded batch), checked against each sequence's own view."""

    def score(self, cache: CacheView) -> torch.Tensor:
        return torch.stack([-k.norm(dim=-1) for k in cache.keys])

    @classmethod
    def score_batch(cls, methods, caches):
        for i, view in enumerate(caches.views):
            for padded, own in zip(caches.keys, view.keys):
                assert torch.equal(padded[i, :, : view.length], own)
            for padded, own in zip(caches.values, view.values):
                assert torch.equal(padded[i, :, : view.length], own)
        cls.calls = getattr(cls, "calls", 0) + 1
        return [torch.stack([-k[i, :, :n].norm(dim=-1) for k in caches.keys]) for i, n in enumerate(caches.lengths)]


def test_score_batch_override_sees_the_padded_caches_of_the_evicting_sequences(engines64, prompts):
    engine = engines64["llama"]
    protocol, settings = Protocol(sink=1), GenerationSettings(max_new_tokens=12)
    alone = [engine.generate(p, _PaddedKeyNorm(), BUDGET, protocol, settings) for p in prompts]
    batched = engine.generate_batch(prompts, [_PaddedKeyNorm() for _ in prompts], BUDGET, protocol, settings)
    assert _PaddedKeyNorm.calls > 0
    for single, result in zip(alone, batched):
        _same(single, result)


def test_slabs_that_must_grow_keep_every_row(engines64, prompts, monkeypatch):
    """Slabs that start with one free slot per row grow as the rows do, every row intact."""
    from kvleague.engine.decode import DecodeLoop

    monkeypatch.setattr(DecodeLoop, "_capacity_for", lambda self, sessions: max(s.cache.length for s in sessions) + 1)
    engine = engines64["qwen2"]
    names = ["full", "knorm"] * 4
    settings = [GenerationSettings(max_new_tokens=n) for n in (12, 20)]
    for setting in settings:
        alone = [engine.generate(p, build_method(n), BUDGET, Protocol(sink=1), setting) for p, n in zip(prompts, names)]
        batched = engine.generate_batch(prompts, [build_method(n) for n in names], BUDGET, Protocol(sink=1), setting)
        for single, result in zip(alone, batched):
            _same(single, result)


def test_bad_batches_are_refused_with_one_line(engines64, prompts):
    engine = engines64["llama"]
    method = build_method("knorm")
    cases = [
        (dict(prompts=prompts[:2], methods=[build_method("knorm")]), "methods: 1 methods for 2 prompts"),
        (dict(prompts=prompts[:2], methods=[method, method]), "the same instance appears twice"),
        (dict(prompts=prompts[:2], methods=[build_method("knorm") for _ in range(2)], seeds=[1]), "seeds: 1 seeds"),
        (dict(prompts=prompts[:2], methods=[build_method("knorm") for _ in range(2)], batch_size=0), "batch_size"),
        (dict(prompts=[prompts[0], []], methods=[build_method("knorm") for _ in range(2)]), "prompt 1 is an empty"),
        (
            dict(prompts=prompts[:2], methods=[build_method("knorm") for _ in range(2)], budget=[BUDGET]),
            "budget: 1 budgets for 2 prompts",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(KvleagueError, match=message):
            engine.generate_batch(**{"budget": BUDGET, **kwargs})


@pytest.mark.parametrize("name", ["h2o", "snapkv", "epikv", "tova"])
def test_rows_with_their_own_budgets_equal_each_alone(engines64, prompts, name):
    """Budgets relative to each prompt (``budget_base: prompt``, the paper regime) differ per row:
    a batch of them gives each row what it gives alone at its own budget."""
    engine = engines64["qwen3"]
    protocol = Protocol(sink=1, recent=2, budget_base="prompt")
    resolved = [protocol.for_prompt(6, len(p)) for p in prompts]
    absolute, budgets = protocol.for_prompts(6, [len(p) for p in prompts])  # what the batched callers use
    assert budgets == [b for _, b in resolved] and all(r[0] == absolute for r in resolved)
    assert len(set(budgets)) == len(prompts)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS)
    alone = [engine.generate(p, build_method(name), b, absolute, settings) for p, b in zip(prompts, budgets)]
    batched = engine.generate_batch(prompts, [build_method(name) for _ in prompts], budgets, absolute, settings)
    for single, row in zip(alone, batched):
        _same(single, row)
    assert all(r.evictions > 0 for r in alone)


def test_auto_batch_size_fits_the_memory_it_is_given(engines64):
    engine = engines64["llama"]
    per_slot = 2 * engine.n_layers * engine.n_kv_heads * engine.head_dim * 8  # float64
    prompts = [100] * 40
    assert auto_batch_size(engine, prompts, 50, 64, available_bytes=1) == 1
    assert auto_batch_size(engine, prompts, 50, 64, available_bytes=1 << 40) == 40  # capped by the prompts
    assert auto_batch_size(engine, [100] * 500, 50, 64, available_bytes=1 << 40) == 64
    # a budget below the prompt: the cache holds the prompt (100 slots); no eviction: prompt + new tokens
    evicting = auto_batch_size(engine, prompts, 50, 64, available_bytes=30 * per_slot * 150)
    full = auto_batch_size(engine, prompts, 50, 64, never_evicts=True, available_bytes=30 * per_slot * 150)
    assert full < evicting <= 40
    assert evicting * per_slot * 100 <= 0.8 * 30 * per_slot * 150


def test_knorm_parts_from_another_run_only_at_a_rounding_tie(engines, prompt_ids):
    """knorm's documented exception (tests/rounding_ties.py), shown on CPU in float32: layer 0's
    repeated tokens tie bit for bit, so one ulp of difference in a tied score (what another kernel's
    rounding does to a key) changes which copy is kept; the check used on CUDA accepts that parting
    and rejects one at scores that do not tie."""
    from tests.rounding_ties import LoggedKnorm, assert_parted_only_at_a_rounding_tie

    @dataclass
    class Nudged(LoggedKnorm):
        """Moves one layer-0 score of the first eviction by ``step`` (default 1 ulp upward: a rounding difference)."""

        slot: int = 0
        step: float | None = None

        def score(self, cache):
            scores = KeyNorm.score(self, cache)
            if not self.log:
                value = scores[0, 0, self.slot]
                scores[0, 0, self.slot] = (
                    torch.nextafter(value, torch.tensor(float("inf"))) if self.step is None else value + self.step
                )
            return self.record(cache.positions, scores)

    engine = engines["llama"]
    protocol, settings, budget = Protocol(), GenerationSettings(max_new_tokens=6), 120
    plain = LoggedKnorm()
    base = engine.generate(prompt_ids, plain, budget, protocol, settings)
    (positions, scores), (after, _) = plain.log[0], plain.log[1]
    row, held, kept = scores[0, 0], positions[0, 0].tolist(), set(after[0, 0].tolist())
    threshold = row.topk(budget).values.min()
    dropped = [i for i, p in enumerate(held) if p not in kept]
    tied = [i for i in dropped if row[i] == threshold]
    assert tied, "the boundary falls inside a tie (tests/test_methods_kvpress.py shows it in every head)"
    nudged = Nudged(slot=tied[0])
    other = engine.generate(prompt_ids, nudged, budget, protocol, settings)
    assert not torch.equal(nudged.log[1][0][0], after[0])  # one ulp: layer 0 kept another copy
    assert assert_parted_only_at_a_rounding_tie(plain, nudged, base.kept_positions, other.kept_positions)
    untied = max((i for i in dropped if threshold - row[i] > 1e-3 * abs(threshold)), key=lambda i: float(row[i]))
    moved = Nudged(slot=untied, step=float(threshold - row[untied]) * (1 + 1e-3) + 1e-6)
    far = engine.generate(prompt_ids, moved, budget, protocol, settings)
    assert not torch.equal(moved.log[1][0][0], after[0])
    with pytest.raises(AssertionError, match="not close"):  # a score moved beyond rounding
        assert_parted_only_at_a_rounding_tie(plain, moved, base.kept_positions, far.kept_positions)


@pytest.mark.parametrize("reduce", [(0, 1), (1,), ()], ids=["token", "layer", "head"])
def test_a_nan_score_is_refused_alone_and_batched(engines64, prompts, reduce):
    """A method whose score has one NaN (scores per token, per layer or per head) is refused with one
    line, by a sequence evicting alone and by rows evicting together (the NaN check rides on the
    eviction's one host read)."""

    class NaNScore(KeyNorm):
        def score(self, cache):
            scores = super().score(cache)  # [L, H, T]
            scores = (scores.mean(dim=reduce) if reduce else scores).clone()
            scores[..., 1] = float("nan")
            return scores

    engine = engines64["llama"]
    same_length = [p[-BUDGET - 2 :] for p in prompts[-4:]]
    with pytest.raises(KvleagueError, match="score: the method returned NaN scores"):
        engine.generate(same_length[0], NaNScore(), BUDGET, Protocol(), GenerationSettings(max_new_tokens=2))
    with pytest.raises(KvleagueError, match="score: the method returned NaN scores"):
        engine.generate_batch(
            same_length, [NaNScore() for _ in same_length], BUDGET, Protocol(), GenerationSettings(max_new_tokens=4)
        )
