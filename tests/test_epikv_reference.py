"""EpiKV under ``protocol: epikv_paper`` against a naive re-implementation of the authors' semantics.

The oracle below follows the authors' ``DetrendendHSVarianceEviction`` / ``BandAdaptiveHSEviction``
under their ``scripts/benchmark.py`` loop (stevenkolawole/epiphany-kv-cache), written from their
description, independently of kvleague's code: a plain HF decode loop (no ``position_ids``, so
positions follow the cache length), ``output_hidden_states``, one score per generated token from
Python-float rolling z-scores of ||h_t - h_{t-1}|| (the first generated token measured against the
last prompt token), rounded to float32, and after every decode forward: the prompt kept whole, the
last min(128, B // 4) generated tokens kept, the rest of the budget to the highest scores (equal
scores: the more recent position, kvleague's stated tie-break; the authors' ``topk`` leaves it open).
Kept positions and greedy tokens are compared after every one of many evictions, and each documented
choice has a mutation that makes kvleague differ from the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from tests.conftest import ARCHS


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    return {
        arch: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
        for arch, path in tiny_models.items()
    }


def _z(series: list[float], window: int) -> float:
    chunk = series[-window:]
    if len(chunk) < 2:
        return 0.0
    mean = sum(chunk) / len(chunk)
    var = sum((x - mean) ** 2 for x in chunk) / len(chunk)
    return (chunk[-1] - mean) / (var**0.5 + 1e-6)


def keep_only(cache, positions: list[int], keep: set[int]) -> list[int]:
    """Drop from an HF cache every slot whose position is not in ``keep`` (slot order kept); the kept positions."""
    index = torch.tensor([i for i, p in enumerate(positions) if p in keep], dtype=torch.long)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
    return [positions[i] for i in index.tolist()]


def oracle_decode(
    model, prompt, n_new, budget, layers_a, layers_b, weights=(1.0, 1.0), window=64, keep_recent=128, signal=_z
):
    """The authors' loop and eviction rule, naively; returns (tokens, kept positions after each step).

    ``signal(series, window)`` reduces each layer group's series to the token's value (z-score: EpiKV)."""
    n_prompt = len(prompt)
    recent = min(keep_recent, budget // 4)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, output_hidden_states=True)
    cache = out.past_key_values
    prev = {l: out.hidden_states[l + 1][0, -1] for l in (*layers_a, *layers_b)}
    token = int(out.logits[0, -1].argmax())
    positions, series_a, series_b, score = list(range(n_prompt)), [], [], {}
    tokens, kept = [], []
    for step in range(n_new):
        tokens.append(token)
        with torch.no_grad():
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, output_hidden_states=True)
        cache = out.past_key_values
        position = n_prompt + step
        positions.append(position)
        changes = []
        for layers in (layers_a, layers_b):
            ds = []
            for l in layers:
                h = out.hidden_states[l + 1][0, -1]
                ds.append(float((h - prev[l]).norm()))
                prev[l] = h
            changes.append(sum(ds) / len(ds))
        series_a.append(changes[0])
        series_b.append(changes[1])
        s = weights[0] * signal(series_a, window) - weights[1] * signal(series_b, window)
        score[position] = float(np.float32(s))
        if len(positions) > budget:
            generated = [p for p in positions if p >= n_prompt]
            protected = set(generated[-recent:]) if recent else set()
            ranked = sorted(generated, key=lambda p: (p in protected, score[p], p), reverse=True)
            keep = set(range(n_prompt)) | set(ranked[: max(budget - n_prompt, 0)])
            positions = keep_only(cache, positions, keep)
        kept.append(list(positions))
        token = int(out.logits[0, -1].argmax())
    return tokens, kept


def kvleague_decode(engine, prompt, n_new, budget, method, protocol):
    """Tokens and kept positions after each forward pass of a generated token (as the oracle's)."""
    tokens, kept = [], []
    with engine.session(method, budget, protocol) as session:
        session.feed(list(prompt))
        for step in range(n_new):
            tokens += session.decode(GenerationSettings(max_new_tokens=1)).token_ids
            if step:
                kept.append(session.kept_positions()[0])
        session.flush_pending()
        kept.append(session.kept_positions()[0])
        evictions = session.evictions
    return tokens, kept, evictions


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("arch", ARCHS)
def test_epikv_equals_authors_semantics_over_many_evictions(engines, hf_models, monkeypatch, arch):
    engine = engines[arch]
    monkeypatch.setattr(engine, "eos_ids", set())
    prompt, budget, steps = _prompt(ARCHS.index(arch), 40), 64, 160
    # layer B = 3 is the last of the 4: its hidden state is taken after the final norm
    expected_tokens, expected_kept = oracle_decode(hf_models[arch], prompt, steps, budget, [1], [3])
    tokens, kept, evictions = kvleague_decode(
        engine,
        prompt,
        steps,
        budget,
        build_method("epikv", {"layer_a": 1, "layer_b": 3}),
        Protocol.preset("epikv_paper"),
    )
    assert evictions >= steps - (budget - len(prompt))  # evicts at every step once the cache is full
    assert _first_difference(kept, expected_kept) is None
    assert tokens == expected_tokens
    assert len({tuple(k) for k in kept[-50:]}) == 50  # the kept set keeps changing (not a trivial recency cut)


def test_epikv_bands_equals_authors_semantics(engines, hf_models, monkeypatch):
    engine = engines["qwen2"]
    monkeypatch.setattr(engine, "eos_ids", set())
    prompt, budget, steps = _prompt(7, 30), 48, 120
    expected = oracle_decode(hf_models["qwen2"], prompt, steps, budget, [0, 1], [2, 3], weights=(1.29, 1.0), window=16)
    method = build_method("epikv_bands", {"layers_a": [0, 1], "layers_b": [2, 3], "window": 16})
    tokens, kept, _ = kvleague_decode(engine, prompt, steps, budget, method, Protocol.preset("epikv_paper"))
    assert (tokens, kept) == expected


def test_prompt_longer_than_budget_is_kept_whole(engines, hf_models, monkeypatch):
    """The authors' harness keeps a prompt longer than B; every generated token then goes at once."""
    engine = engines["llama"]
    monkeypatch.setattr(engine, "eos_ids", set())
    prompt, budget, steps = _prompt(3, 70), 64, 40
    expected = oracle_decode(hf_models["llama"], prompt, steps, budget, [1], [2])
    method = build_method("epikv", {"layer_a": 1, "layer_b": 2})
    tokens, kept, _ = kvleague_decode(engine, prompt, steps, budget, method, Protocol.preset("epikv_paper"))
    assert all(k == list(range(70)) for k in kept)
    assert (tokens, kept) == expected
    with pytest.raises(KvleagueError, match="prompt_over_budget"):
        kvleague_decode(engine, prompt, 3, budget, method, Protocol.preset("epikv_paper", prompt_over_budget="error"))


# -- mutations: each documented choice, changed, makes kvleague differ from the oracle -------------------


MUTATIONS = {
    "series over prompt tokens": ({"series": "all"}, {}),
    "last layer before the final norm": ({"last_layer": "residual"}, {}),
    "recent window not capped at B // 4": ({}, {"recent_max_fraction": None}),
    "true positions instead of the cache length": ({}, {"positions": "absolute"}),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_documented_choice_breaks_the_oracle_when_changed(engines, hf_models, monkeypatch, mutation):
    engine = engines["llama"]
    monkeypatch.setattr(engine, "eos_ids", set())
    prompt, budget, steps = _prompt(0, 40), 64, 100
    expected_tokens, expected_kept = oracle_decode(hf_models["llama"], prompt, steps, budget, [1], [3])
    params, overrides = MUTATIONS[mutation]
    method = build_method("epikv", {"layer_a": 1, "layer_b": 3, **params})
    protocol = Protocol.preset("epikv_paper", **overrides)
    if mutation.startswith("recent"):
        protocol = Protocol.preset("epikv_paper", recent_max_fraction=None, recent=20)
    tokens, kept, _ = kvleague_decode(engine, prompt, steps, budget, method, protocol)
    assert (tokens, kept) != (expected_tokens, expected_kept)


def test_reference_arithmetic_stores_float32_scores():
    """``arithmetic="reference"`` rounds each score to float32 as the authors' tensor does; float64 does not."""
    from tests.test_method_formulas import _info, _obs

    rng = np.random.default_rng(5)
    hidden = torch.tensor(rng.normal(size=(60, 8)), dtype=torch.float32)
    scores = {}
    for arithmetic in ("reference", "float64"):
        method = build_method("epikv", {"layer_a": 0, "layer_b": 1, "arithmetic": arithmetic})
        method.reset(_info(n_layers=4))  # layers 0 and 1: not the last, so no final norm involved
        method.observe(_obs(list(range(10)), {0: hidden[:10], 1: hidden[:10].flip(0)}, phase="prefill", n_layers=4))
        for t in range(10, 60):
            method.observe(_obs([t], {0: hidden[t : t + 1], 1: hidden[t : t + 1] * 2}, n_layers=4))
        scores[arithmetic] = method.table.read(torch.arange(60))
    ref, f64 = scores["reference"], scores["float64"]
    assert torch.isinf(ref[:10]).all() and torch.isinf(f64[:10]).all()  # the prompt is not scored
    assert torch.equal(ref[10:], ref[10:].float().double())
    assert not torch.equal(f64[10:], f64[10:].float().double())
    torch.testing.assert_close(ref[10:], f64[10:], rtol=1e-6, atol=1e-6)


def test_epikv_paper_preset_is_one_line_in_a_sweep_and_is_stored(tmp_path):
    from kvleague.db.models import ProtocolSpec
    from kvleague.db.session import get_engine, upgrade
    from kvleague.db.store import get_or_create
    from kvleague.engine.protocol import PRESETS
    from kvleague.runner.sweep_config import parse_config

    config = parse_config(
        {
            "name": "replication",
            "database": f"sqlite:///{tmp_path / 'r.db'}",
            "models": [{"source": "x/y"}],
            "methods": ["epikv"],
            "budgets": [512],
            "tasks": ["math500"],
            "protocol": "epikv_paper",
        }
    )
    protocol = config.protocol_for("math", True)
    assert protocol == PRESETS["epikv_paper"]
    assert protocol.recent_for(512) == 128 and protocol.recent_for(256) == 64 and protocol.prompt_over_budget == "keep"
    # a protocol that does not use the preset fields resolves (and hashes) as before they existed
    plain = parse_config({**config.model_dump(), "protocol": {"recent": 8}}).protocol_for("math", True)
    assert set(plain.spec()) == {"cadence", "positions", "sink", "recent", "protect_prompt", "prefill_chunk"}
    engine = get_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade(engine)
    assert get_or_create(engine, ProtocolSpec, {"spec_hash": "h" * 64, **protocol.spec()}) == 1
    with pytest.raises(KvleagueError, match="unknown preset"):
        parse_config({**config.model_dump(), "protocol": "epikv_papr"})


# -- the authors' H2O (their harness variant), against a naive eager re-implementation ----------------


def oracle_h2o_authors(model, prompt, n_new, budget, n_sink=4, keep_recent=128):
    """The authors' H2OEviction semantics: decode attention (mean over heads, then layers) summed per
    slot from the first decode step on; sinks min(4, B/4), recent min(128, B - sinks), prompt
    evictable; positions = cache length (no position_ids)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    positions, acc, tokens, kept = list(range(len(prompt))), {}, [], []
    sinks = min(n_sink, budget // 4)
    recent = min(keep_recent, budget - sinks)
    for step in range(n_new):
        tokens.append(token)
        with torch.no_grad():
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, output_attentions=True)
        cache = out.past_key_values
        positions.append(len(prompt) + step)
        received = torch.stack([a[0, :, -1].mean(dim=0) for a in out.attentions]).mean(dim=0)
        for p, r in zip(positions, received.tolist()):
            acc[p] = float(np.float32(acc.get(p, 0.0) + np.float32(r)))
        if len(positions) > budget:
            middle = positions[sinks : len(positions) - recent]
            heavy = sorted(middle, key=lambda p: (acc[p], p), reverse=True)[: budget - sinks - recent]
            keep = set(positions[:sinks]) | set(positions[len(positions) - recent :]) | set(heavy)
            positions = keep_only(cache, positions, keep)
        kept.append(list(positions))
        token = int(out.logits[0, -1].argmax())
    return tokens, kept


def test_h2o_authors_equals_the_authors_semantics_over_many_evictions(engines, tiny_models, monkeypatch):
    engine = engines["qwen3"]
    monkeypatch.setattr(engine, "eos_ids", set())
    eager = AutoModelForCausalLM.from_pretrained(
        str(tiny_models["qwen3"]), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt, budget, steps = _prompt(11, 20), 150, 170  # 4 sinks, 128 recent, 18 heavy hitters; 40 evictions
    expected = oracle_h2o_authors(eager, prompt, steps, budget)
    got = kvleague_decode(engine, prompt, steps, budget, build_method("h2o_authors"), Protocol(positions="compact"))
    assert got[2] >= steps - (budget - len(prompt))
    assert (got[0], got[1]) == expected
    # not a recency cut: some heavy hitters from the middle survive while newer tokens go
    assert any(k[4:22] != list(range(k[4], k[4] + 18)) for k in got[1][-30:])
    # mutation: the original H2O (prefill attention accumulated, per KV head, recent half) differs
    original = kvleague_decode(engine, prompt, steps, budget, build_method("h2o"), Protocol(positions="compact"))
    assert (original[0], original[1]) != expected
