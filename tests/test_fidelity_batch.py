"""Batched fidelity (``fidelity.measure_batch``) against ``fidelity.measure`` one sequence at a time.

Every built-in method in one batch per architecture (float64): sequences with different prompt
lengths, answer lengths and budgets, each under the architecture's protocol (sinks and a recent
window; compact positions, a buffered cadence and a protected prompt; chunked prefill), must give
the same per-token KL, delta NLL and top-1 agreement, the same kept positions and eviction counts as
alone. ``measure`` is itself checked against a naive re-computation in tests/test_fidelity.py.
"""

from __future__ import annotations

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.methods import available_methods, build_method
from kvleague.runner import fidelity
from tests.conftest import ARCHS
from tests.test_batch import PROTOCOLS, engines64  # noqa: F401 - the float64 engines fixture

METHODS = sorted(available_methods())
BUDGETS = (12, 16, 20)


def _samples(engine, n: int) -> list[list[fidelity.Segment]]:
    text = "A budget forces a choice at every step; the reference answer shows what the choice cost. " * 3
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    # prompts below, at and above every budget; answers of different lengths end at different steps
    return [[(ids[i : i + 6 + 3 * (i % 7)], False), (ids[40 + i : 40 + i + 9 + 2 * (i % 5)], True)] for i in range(n)]


def _same(alone: fidelity.FidelityResult, batched: fidelity.FidelityResult) -> None:
    # float64 agrees to ~1e-16, except under eager attention, whose softmax HF computes in float32:
    # padded batch rows round differently there (measured: 3e-8 absolute at most)
    tolerance = 1e-6 if alone.generation.attn_implementation == "eager" else 1e-12
    for name in ("kl", "delta_nll", "top1"):
        assert batched.per_token[name] == pytest.approx(alone.per_token[name], rel=tolerance, abs=tolerance), name
    assert batched.tokens == alone.tokens
    a, b = alone.generation, batched.generation
    assert b.kept_positions == a.kept_positions
    for name in (
        "evictions",
        "evicted_tokens",
        "peak_cache_entries",
        "prompt_tokens",
        "generated_tokens",
        "token_ids",
        "budget",
    ):
        assert getattr(b, name) == getattr(a, name), name


@pytest.mark.parametrize("arch", ARCHS)
def test_each_sequence_of_a_fidelity_batch_equals_it_alone(engines64, arch):
    engine, protocol = engines64[arch], PROTOCOLS[arch]
    samples = _samples(engine, len(METHODS))
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(len(METHODS))]
    seeds = list(range(len(METHODS)))
    alone = [
        fidelity.measure(engine, s, build_method(name), b, protocol, seed, per_token=True)
        for s, name, b, seed in zip(samples, METHODS, budgets, seeds)
    ]
    batched = fidelity.measure_batch(
        engine,
        samples,
        [build_method(n) for n in METHODS],
        budgets,
        protocol,
        seeds,
        batch_size=len(METHODS),
        per_token=True,
    )
    for one, many in zip(alone, batched):
        _same(one, many)
    evicting = [r.generation.evictions for r, n in zip(alone, METHODS) if not build_method(n).never_evicts]
    assert sum(e > 0 for e in evicting) >= len(evicting) // 2  # the batch really evicted, at different steps
    assert len(set(evicting)) > 3


def test_one_reference_serves_many_methods_and_multi_turn_samples_run_alone(engines64):
    """The sweep's use: one sample, its full-cache pass computed once, many methods and budgets; a
    multi-turn sample (a scored turn between unscored segments) falls back to ``measure``."""
    engine, protocol = engines64["llama"], PROTOCOLS["llama"]
    one = _samples(engine, 3)[2]
    multi = [one[0], one[1], (one[0][0][:5], False), (one[1][0][:4], True)]
    names = ["h2o", "epikv", "knorm", "full", "snapkv"]
    samples = [one] * 4 + [multi]
    references = [fidelity.full_cache_logprobs(engine, s) for s in samples]
    budgets = [12, 16, 12, 12, 16]
    batched = fidelity.measure_batch(
        engine, samples, [build_method(n) for n in names], budgets, protocol, references=references, per_token=True
    )
    for s, name, b, r in zip(samples, names, budgets, batched):
        _same(fidelity.measure(engine, s, build_method(name), b, protocol, per_token=True), r)
        assert r.reference_seconds == 0.0  # the references were given
    assert batched[3].kl_mean < 1e-9  # the full cache against itself
    assert not fidelity.single_answer(multi) and fidelity.single_answer(one)


def test_bad_fidelity_batches_are_refused_with_one_line(engines64):
    engine = engines64["llama"]
    samples = _samples(engine, 2)
    with pytest.raises(KvleagueError, match="2 samples, 1 methods"):
        fidelity.measure_batch(engine, samples, [build_method("h2o")], [12, 12])
    shared = build_method("h2o")
    with pytest.raises(KvleagueError, match="same instance"):
        fidelity.measure_batch(engine, samples, [shared, shared], [12, 12])
    with pytest.raises(KvleagueError, match="batch_size"):
        fidelity.measure_batch(engine, samples, [build_method("h2o"), build_method("h2o")], [12, 12], batch_size=0)
