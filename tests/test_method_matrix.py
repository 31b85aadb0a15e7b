"""Every registered method (entry-point plugins included) x tiny llama/qwen2/qwen3 x {prefill, decode}.

For each cell: the budget is respected, scores are never NaN and have an allowed shape, a run is
deterministic for a seed, per-sequence state is reset (sequence A then B on one instance gives the
same result for B as B alone on a fresh instance), and the model runs under SDPA unless the method
declares ``needs.eager``.
"""

from __future__ import annotations

import pytest
import torch

from methods import available_methods, build_method
from runner.protocol import GenerationSettings, Protocol
from tests.conftest import ARCHS

METHODS = sorted(available_methods())
BUDGET = 40
SEED = 5
SAMPLED = dict(temperature=1.0, top_p=0.95)  # seeded sampling: exercises the session's generator too

MODES = {
    # prompt longer than the budget: compressed after prefill, then at every decode step
    "prefill": dict(prompt=slice(None), protocol=Protocol(sink=2), new_tokens=12),
    # short protected prompt: the cache fills up while decoding, then evicts at every step
    "decode": dict(prompt=slice(0, 16), protocol=Protocol(recent=6, protect_prompt=True), new_tokens=44),
}


def _run(engine, method, prompt, mode, new_tokens=None):
    """One sequence; returns (tokens, kept positions, result) and checks every score it returns."""
    spec = MODES[mode]
    shapes = []
    original = method.score

    def checked(cache):
        scores = original(cache)
        t = cache.length
        allowed = {(t,), (engine.n_layers, t), (engine.n_layers, engine.n_kv_heads, t)}
        assert isinstance(scores, torch.Tensor) and tuple(scores.shape) in allowed, tuple(scores.shape)
        assert not torch.isnan(scores).any(), "NaN score"
        shapes.append(tuple(scores.shape))
        return scores

    method.score = checked
    try:
        settings = GenerationSettings(max_new_tokens=new_tokens or spec["new_tokens"], **SAMPLED)
        result = engine.generate(prompt[spec["prompt"]], method, BUDGET, spec["protocol"], settings, seed=SEED)
    finally:
        del method.score
    return result, shapes


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", METHODS)
def test_method_matrix(engines, prompt_ids, monkeypatch, name, arch, mode):
    engine = engines[arch]
    monkeypatch.setattr(engine, "eos_ids", set())  # a sampled EOS must not end a cell before it evicts
    other_prompt = list(reversed(prompt_ids))  # sequence A: different tokens, same length

    alone, shapes = _run(engine, build_method(name), prompt_ids, mode)
    reused = build_method(name)
    _run(engine, reused, other_prompt, mode, new_tokens=MODES[mode]["new_tokens"] // 2)
    after_other, _ = _run(engine, reused, prompt_ids, mode)

    method = build_method(name)
    assert alone.attn_implementation == ("eager" if method.needs.eager else "sdpa")
    n_prompt = len(prompt_ids[MODES[mode]["prompt"]])
    if method.never_evicts:
        assert alone.evictions == 0 and not shapes
    else:
        assert alone.evictions > 0 and shapes, "the cache never exceeded the budget: the cell tests nothing"
        for layer in alone.kept_positions:  # [T] or [H][T]
            heads = layer if isinstance(layer[0], list) else [layer]
            assert all(len(h) == BUDGET for h in heads)
            assert all(h == sorted(set(h)) for h in heads)
        # every forward pass appends to a cache that held <= budget entries (every_step cadence)
        assert alone.peak_cache_entries <= max(n_prompt, BUDGET + 1)
    # deterministic for a seed, and no state leaks from sequence A into sequence B
    assert after_other.token_ids == alone.token_ids, "B after A differs from B alone (state leak or nondeterminism)"
    assert after_other.kept_positions == alone.kept_positions
