"""Every registered method (entry-point plugins included) x tiny llama/qwen2/qwen3 x {prefill, decode}.

For each cell: the budget is respected, scores are never NaN and have an allowed shape, a run is
deterministic for a seed, per-sequence state is reset (sequence A then B on one instance gives the
same result for B as B alone on a fresh instance), and the model runs under SDPA unless the method
declares ``needs.eager``.
"""

from __future__ import annotations

import pytest
import torch

from kvleague.engine.contract import EvictionMethod, Needs
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import available_methods, build_method
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
        shapes.append((tuple(scores.shape), bool((scores == float("-inf")).any())))
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
        # a -inf score asks for the slot to go even below B (engine/contract.py); otherwise exactly B stay
        asked_fewer = any(fewer for _, fewer in shapes)
        for layer in alone.kept_positions:  # [T] or [H][T]
            heads = layer if isinstance(layer[0], list) else [layer]
            assert all(len(h) <= BUDGET if asked_fewer else len(h) == BUDGET for h in heads)
            assert all(h == sorted(set(h)) for h in heads)
        # every forward pass appends to a cache that held <= budget entries (every_step cadence)
        assert alone.peak_cache_entries <= max(n_prompt, BUDGET + 1)
    # deterministic for a seed, and no state leaks from sequence A into sequence B
    assert after_other.token_ids == alone.token_ids, "B after A differs from B alone (state leak or nondeterminism)"
    assert after_other.kept_positions == alone.kept_positions


# -- the engine's selection rule: one deterministic tie-break by absolute position -------------------


@pytest.mark.parametrize("shape", [(50,), (3, 50), (3, 2, 50)], ids=["T", "LT", "LHT"])
@pytest.mark.parametrize("k", [7, 24, 25, 26, 43, "per row"], ids=lambda k: f"k{k}")
def test_keep_top_keeps_highest_scores_then_most_recent_whatever_the_slot_order(shape, k):
    """Against a plain lexicographic sort on (score, position), for one count and a count per row."""
    from kvleague.engine.selection import keep_top

    gen = torch.Generator().manual_seed(len(shape))
    scores = torch.randint(0, 4, shape, generator=gen).double()  # many exact ties
    scores[..., 3] = float("inf")
    positions = torch.stack([torch.randperm(shape[-1], generator=gen) for _ in range(scores.numel() // shape[-1])])
    positions = positions.view(shape) * 3 + 100  # shuffled slots, gaps in the positions
    rows = scores.numel() // shape[-1]
    counts = torch.randint(1, shape[-1], (rows,), generator=gen) if k == "per row" else torch.full((rows,), k)
    keep = keep_top(scores, counts.view(*shape[:-1], 1) if k == "per row" else k, positions)
    flat_s, flat_p, flat_k = (
        scores.reshape(-1, shape[-1]),
        positions.reshape(-1, shape[-1]),
        keep.reshape(-1, shape[-1]),
    )
    for s, p, kept, n in zip(flat_s, flat_p, flat_k, counts.tolist()):
        order = sorted(range(shape[-1]), key=lambda i: (float(s[i]), int(p[i])), reverse=True)
        assert set(kept.nonzero()[:, 0].tolist()) == set(order[:n])


class _Constant(EvictionMethod):
    """Every slot scores the same: what stays is decided by the tie-break alone."""

    needs = Needs(ordered_slots=False)  # the hole-filling path, which scrambles slot order

    def score(self, cache):
        return torch.zeros(cache.length)


def test_equal_scores_keep_the_most_recent_positions_on_the_order_free_path(engines, prompt_ids):
    result = engines["qwen2"].generate(
        prompt_ids, _Constant(), BUDGET, Protocol(), GenerationSettings(max_new_tokens=20)
    )
    newest = len(prompt_ids) + 20 - 2  # the last sampled token is not fed
    assert result.kept_positions[0] == list(range(newest - BUDGET + 1, newest + 1))


def test_kept_prompt_beyond_the_recent_window_keeps_the_newest_of_the_window(engines, prompt_ids, monkeypatch):
    """epikv_paper, prompt + recent > B: the prompt stays, the newest generated tokens fill what is left."""
    monkeypatch.setattr(engines["llama"], "eos_ids", set())
    prompt, budget = prompt_ids[:56], 64  # recent window min(128, 64 // 4) = 16 > 64 - 56
    result = engines["llama"].generate(
        prompt, _Constant(), budget, Protocol.preset("epikv_paper"), GenerationSettings(max_new_tokens=30)
    )
    newest = 56 + 30 - 2
    assert result.kept_positions[0] == list(range(56)) + list(range(newest - 7, newest + 1))
