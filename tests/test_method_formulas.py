"""Each method's formula against an oracle written independently of the method's code.

The oracles are direct numpy/torch re-computations from the definitions in the docstrings (loops,
no shared helpers), fed either hand-made inputs or the real tiny models' own forward passes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvleague.engine.contract import CacheView, Observation, SequenceInfo
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from tests.conftest import ARCHS


def _info(n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8, budget=16) -> SequenceInfo:
    return SequenceInfo(n_layers, n_heads, n_kv_heads, head_dim, n_heads * head_dim, budget, 0, torch.device("cpu"))


def _view(keys, values=None, positions=None, is_prompt=None, budget=8, current=None) -> CacheView:
    """A CacheView over per-layer ``[H, T, d]`` keys, every slot holding the same positions."""
    h, t, _ = keys[0].shape
    pos = torch.arange(t) if positions is None else torch.as_tensor(positions)
    prompt = torch.zeros(t, dtype=torch.bool) if is_prompt is None else torch.as_tensor(is_prompt)
    return CacheView(
        keys=list(keys),
        values=list(values if values is not None else keys),
        positions=[pos[None].expand(h, t) for _ in keys],
        is_prompt=[prompt[None].expand(h, t) for _ in keys],
        budget=budget,
        phase="decode",
        current_position=int(pos.max()) if current is None else current,
    )


def _obs(positions, hidden=None, keys=None, queries=None, attention=None, phase="decode", n_layers=8, n_kv=2):
    positions = torch.as_tensor(positions)
    return Observation(
        phase=phase,
        new_positions=positions,
        new_token_ids=torch.zeros_like(positions),
        cache_positions=[torch.arange(int(positions.max()) + 1)[None].expand(n_kv, -1) for _ in range(n_layers)],
        hidden_states=hidden,
        new_keys=keys,
        new_values=keys,
        queries=queries,
        attention=attention,
    )


# -- EpiKV: z-score and score on a hand-made hidden-state series --------------------------------------


def np_rolling_z(x: np.ndarray, window: int) -> np.ndarray:
    """The docstring's definition, directly: window = last W values ending at t; population std."""
    z = np.zeros(len(x))
    for t in range(len(x)):
        w = x[max(0, t - window + 1) : t + 1]
        z[t] = (x[t] - w.mean()) / (w.std() + 1e-6)
    return z


def np_change(h: np.ndarray) -> np.ndarray:
    """d_t = ||h_t - h_{t-1}||, d_0 = 0."""
    d = np.zeros(len(h))
    for t in range(1, len(h)):
        d[t] = np.sqrt(((h[t] - h[t - 1]) ** 2).sum())
    return d


def test_rolling_zscore_conventions():
    from kvleague.methods.epikv import rolling_zscore

    # one value: population std 0 -> z = 0 (a sample std would be NaN)
    assert rolling_zscore([], torch.tensor([3.0]), 4).item() == 0.0
    # the window includes x_t: for [0, 2], mean 1, population std 1 -> z = 1 / (1 + 1e-6)
    z = rolling_zscore([0.0], torch.tensor([2.0]), 4).item()
    assert z == pytest.approx(1 / (1 + 1e-6), rel=1e-12)
    # only the last W values count
    assert rolling_zscore([100.0, 0.0, 1.0], torch.tensor([2.0]), 3).item() == pytest.approx(1.2247436, rel=1e-5)


#: kvleague's earlier EpiKV variant: series over every token, last layer before the norm, float64
LEGACY = {"series": "all", "arithmetic": "float64", "last_layer": "residual"}


def py_rolling_z(x: list[float], window: int) -> list[float]:
    """The authors' arithmetic: Python floats, left-to-right sums, z = 0 for a one-value window."""
    out = []
    for t in range(len(x)):
        chunk = x[max(0, t - window + 1) : t + 1]
        if len(chunk) < 2:
            out.append(0.0)
            continue
        mean = sum(chunk) / len(chunk)
        var = sum((v - mean) ** 2 for v in chunk) / len(chunk)
        out.append((chunk[-1] - mean) / (var**0.5 + 1e-6))
    return out


@pytest.mark.parametrize("variant", ["authors", "legacy"])
@pytest.mark.parametrize("window", [5, 64])
def test_epikv_score_on_hand_made_series_matches_numpy(window, variant):
    rng = np.random.default_rng(0)
    n, hidden, layer_a, layer_b, n_prompt = 150, 16, 2, 5, 47
    # a random walk with bursts, so the change series has structure
    h_a = np.cumsum(rng.normal(size=(n, hidden)) * rng.choice([0.1, 1.0, 5.0], size=(n, 1)), axis=0)
    h_b = np.cumsum(rng.normal(size=(n, hidden)) * rng.choice([0.2, 2.0], size=(n, 1)), axis=0)
    params = {"window": window, "layer_a": layer_a, "layer_b": layer_b, **(LEGACY if variant == "legacy" else {})}
    method = build_method("epikv", params)
    method.reset(_info())
    assert list(method.hidden_layers(8)) == [layer_a, layer_b]
    # a prefill in two chunks, then decode steps one token at a time
    bounds = [0, 40, n_prompt] + list(range(n_prompt + 1, n + 1))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        hidden_states = {
            layer_a: torch.tensor(h_a[lo:hi], dtype=torch.float32),
            layer_b: torch.tensor(h_b[lo:hi], dtype=torch.float32),
        }
        method.observe(_obs(list(range(lo, hi)), hidden_states, phase="prefill" if lo < n_prompt else "decode"))
    ha32, hb32 = (h.astype(np.float32).astype(np.float64) for h in (h_a, h_b))
    if variant == "legacy":
        expected = np_rolling_z(np_change(ha32), window) - np_rolling_z(np_change(hb32), window)
    else:  # generated tokens only; the first one's change is against the last prompt token
        d_a, d_b = np_change(ha32)[n_prompt:].tolist(), np_change(hb32)[n_prompt:].tolist()
        z = np.array(py_rolling_z(d_a, window)) - np.array(py_rolling_z(d_b, window))
        expected = np.concatenate([np.full(n_prompt, np.inf), z])
    # score every position, in a shuffled cache order
    order = rng.permutation(n)
    got = method.score(_view([torch.zeros(2, n, 4)], positions=order, current=n - 1))
    np.testing.assert_allclose(got.numpy(), expected[order], rtol=1e-5, atol=1e-5)
    # scores are frozen: later tokens never change earlier ones
    method.observe(_obs([n], {layer_a: torch.ones(1, hidden) * 1e3, layer_b: torch.zeros(1, hidden)}))
    again = method.score(_view([torch.zeros(2, n, 4)], positions=order, current=n))
    assert torch.equal(again, got)


def test_epikv_last_layer_is_read_after_the_final_norm():
    """Engine hidden index ``n_layers`` is the final norm's output (HF ``hidden_states[-1]``)."""
    assert list(build_method("epikv", {"layer_a": 1, "layer_b": 7}).hidden_layers(8)) == [1, 8]
    assert list(build_method("epikv", {"layer_a": 1, "layer_b": 7, "last_layer": "residual"}).hidden_layers(8)) == [
        1,
        7,
    ]
    assert list(build_method("epikv_bands", {"layers_a": [0], "layers_b": [6, 7]}).hidden_layers(8)) == [0, 6, 8]


def test_epikv_default_layers_follow_relative_depth():
    method = build_method("epikv")
    assert list(method.hidden_layers(32)) == [10, 21]
    assert list(method.hidden_layers(28)) == [9, 18]
    bands = build_method("epikv_bands")
    a, b = bands.groups(32)
    assert (a, b) == (list(range(7, 14)), list(range(18, 26)))


def test_epikv_value_reserve_keeps_largest_value_range_generated_tokens():
    n, h, d = 12, 2, 4
    method = build_method("epikv", {"layer_a": 0, "layer_b": 1, "value_reserve": 2, **LEGACY})
    method.reset(_info(n_layers=2))
    rng = np.random.default_rng(1)
    hidden = torch.tensor(rng.normal(size=(n, 6)), dtype=torch.float32)
    method.observe(_obs(list(range(n)), {0: hidden, 1: hidden.flip(0)}, n_layers=2))
    values = torch.zeros(h, n, d)
    spread = torch.tensor([9.0, 0, 0, 1, 2, 7, 3, 0, 5, 0, 0, 4])  # position 0 is a prompt token
    values[:, :, 0] = spread
    prompt = torch.arange(n) < 2
    view = _view([torch.zeros(h, n, d)] * 2, [values, values * 0.5], is_prompt=prompt)
    scores = method.score(view)
    top = set(torch.topk(scores, 2).indices.tolist())
    assert top == {5, 8}  # the two generated tokens with the largest mean range (7 and 5); not the prompt's 9


# -- EpiKV: the kept set on a real tiny-model decode --------------------------------------------------


def _full_hidden(model, ids, layers):
    """Decoder-layer outputs ``[N, hidden]`` for a full-cache forward (HF ``hidden_states[l + 1]``;
    the last layer's output is taken before the final norm, by a hook, as the method defines it)."""
    last = len(model.model.layers) - 1
    grabbed = {}
    handle = model.model.layers[last].register_forward_hook(
        lambda m, a, out: grabbed.setdefault("h", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
    finally:
        handle.remove()
    hidden = {}
    for layer in layers:
        h = grabbed["h"] if layer == last else out.hidden_states[layer + 1]
        hidden[layer] = h[0].double().numpy()
    return hidden, out.past_key_values


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "name,params,group_a,group_b,weights",
    [
        ("epikv", {"layer_a": 1, "layer_b": 2, "window": 16}, [1], [2], (1.0, 1.0)),
        ("epikv", {}, [1], [3], (1.0, 1.0)),  # default depths on 4 layers: B is the last layer
        ("epikv", {"layer_a": 0, "layer_b": 2, "value_reserve": 5}, [0], [2], (1.0, 1.0)),
        ("epikv_bands", {"band_a": (0.0, 0.25), "band_b": (0.5, 0.75), "window": 24}, [0, 1], [2, 3], (1.29, 1.0)),
    ],
)
def test_epikv_kept_set_on_tiny_model_equals_naive_reimplementation(
    engines, prompt_ids, monkeypatch, arch, name, params, group_a, group_b, weights
):
    """kvleague's variant (``series: all``, pre-norm last layer, float64; the authors' defaults are
    checked over many evictions in ``tests/test_epikv_reference.py``). The cache grows untouched (so
    every hidden state equals a full-cache forward's) until one eviction at the last step cuts it from
    B + buffer to B; the naive oracle recomputes the kept set."""
    engine = engines[arch]
    monkeypatch.setattr(engine, "eos_ids", set())
    prompt, budget, buffer, recent = prompt_ids[:40], 50, 49, 4
    n_fed = budget + buffer + 1 - len(prompt)  # the fed decode token that pushes the cache past B + buffer
    protocol = Protocol(recent=recent, cadence=f"buffer={buffer}")
    with engine.session(build_method(name, {**params, **LEGACY}), budget, protocol) as session:
        session.feed(prompt)
        out = session.decode(GenerationSettings(max_new_tokens=n_fed + 1))
        kept = sorted(session.cache.positions[0][0].tolist())
        assert session.evictions == 1 and all(
            torch.equal(p[0], session.cache.positions[0][0]) for p in session.cache.positions
        )
    ids = prompt + out.token_ids[:n_fed]
    n = len(ids)
    hidden, full_cache = _full_hidden(engine.model, ids, sorted(set(group_a) | set(group_b)))
    window = params.get("window", 64)

    def group_z(layers):
        d = np.mean([np_change(hidden[l]) for l in layers], axis=0)
        return np_rolling_z(d, window)

    score = weights[0] * group_z(group_a) - weights[1] * group_z(group_b)
    reserve = params.get("value_reserve", 0)
    if reserve:
        ranges = np.mean(
            [
                (layer.values[0].amax(-1) - layer.values[0].amin(-1)).mean(0).double().numpy()
                for layer in full_cache.layers
            ],
            axis=0,
        )
        generated = np.arange(n) >= len(prompt)
        top = np.argsort(-np.where(generated, ranges, -np.inf), kind="stable")[:reserve]
        score[top] = 1e9 + ranges[top]
    protected = set(range(n - recent, n))
    candidates = [p for p in np.argsort(-score, kind="stable") if p not in protected]
    expected = sorted(protected | set(int(p) for p in candidates[: budget - recent]))
    assert kept == expected


# -- H2O: accumulated attention = column sums of explicit eager attention ------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [None, 16])
def test_h2o_accumulated_attention_equals_eager_column_sums(engines, tiny_models, prompt_ids, arch, chunk):
    engine = engines[arch]
    method = build_method("h2o", {"recent_ratio": 0.0})
    prompt = prompt_ids[:60]
    with engine.session(method, 4096, Protocol(prefill_chunk=chunk)) as session:
        session.feed(prompt)
        out = session.decode(GenerationSettings(max_new_tokens=12))
        view = session.cache.view(session.budget, "decode", session.next_position - 1)
        acc = method.score(view)  # recent_ratio 0: exactly the accumulated sums
    ids = prompt + out.token_ids[:-1]
    eager = AutoModelForCausalLM.from_pretrained(tiny_models[arch], attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(torch.tensor([ids]), output_attentions=True).attentions
    group = engine.n_heads // engine.n_kv_heads
    for layer, a in enumerate(attentions):
        columns = a[0].double().sum(dim=1)  # [H_q, T]: every query's weight, summed per key
        expected = torch.stack([columns[h * group : (h + 1) * group].mean(0) for h in range(engine.n_kv_heads)])
        torch.testing.assert_close(acc[layer].double(), expected, rtol=1e-4, atol=1e-5)


def test_h2o_accumulation_survives_per_head_eviction(engines, prompt_ids):
    """With real evictions (per KV head), each kept slot's score is the sum of the attention rows it
    received while cached, re-derived from the raw observations keyed by (layer, head, position)."""
    engine = engines["qwen2"]
    method = build_method("h2o", {"recent_ratio": 0.25})
    log = []
    original = method.observe

    def spy(obs):
        log.append(([r.clone() for r in obs.attention], [p.clone() for p in obs.cache_positions]))
        original(obs)

    method.observe = spy
    budget = 40
    with engine.session(method, budget, Protocol()) as session:
        session.feed(prompt_ids[:48])
        session.decode(GenerationSettings(max_new_tokens=30))
        positions = [p.clone() for p in session.cache.positions]
        current = session.next_position - 1
        scores = method.score(session.cache.view(budget, "decode", current))
    group = engine.n_heads // engine.n_kv_heads
    totals: dict = {}
    for rows, cache_positions in log:
        for layer, (r, pos) in enumerate(zip(rows, cache_positions)):
            col = r.double().sum(dim=1)
            for h in range(engine.n_kv_heads):
                received = col[h * group : (h + 1) * group].mean(0)
                for slot, p in enumerate(pos[h].tolist()):
                    totals[(layer, h, p)] = totals.get((layer, h, p), 0.0) + float(received[slot])
    assert len({tuple(p.flatten().tolist()) for p in positions}) > 1  # heads/layers really differ
    for layer, pos in enumerate(positions):
        for h in range(engine.n_kv_heads):
            for slot, p in enumerate(pos[h].tolist()):
                s = float(scores[layer, h, slot])
                if p > current - budget // 4:
                    assert s == float("inf")
                else:
                    # a token evicted and never re-admitted cannot be in the cache, so the running
                    # total over the observations that showed it equals the method's sum
                    assert s == pytest.approx(totals[(layer, h, p)], rel=1e-4, abs=1e-6)


# -- SnapKV decode window: recomputed attention equals eager attention ---------------------------------


def test_snapkv_window_attention_equals_eager_rows(engines, tiny_models, prompt_ids):
    from kvleague.methods.kernels import QueryWindow, window_attention

    engine = engines["llama"]
    method = build_method("snapkv", {"window": 8})
    with engine.session(method, 4096, Protocol()) as session:
        session.feed(prompt_ids[:30])
        out = session.decode(GenerationSettings(max_new_tokens=6))  # window: 3 prompt + 5 decode queries
        view = session.cache.view(4096, "decode", session.next_position - 1)
        window: QueryWindow = method.queries
        rows = torch.cat([attn for attn, _, _ in window_attention(window, view)], dim=1)[0]  # [L, H_q, w, T]
    ids = prompt_ids[:30] + out.token_ids[:-1]
    eager = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(engine.n_layers):
        torch.testing.assert_close(rows[layer], attentions[layer][0, :, -8:, :], rtol=1e-4, atol=1e-6)


# -- R-KV: duplicated keys are the most redundant ---------------------------------------------------


def test_rkv_redundancy_ranks_duplicated_keys_lowest():
    from kvleague.methods.rkv import redundancy

    torch.manual_seed(0)
    t, d, dup = 24, 32, [4, 11, 17]
    basis = torch.linalg.qr(torch.randn(d, d))[0].T  # orthonormal rows: distinct keys have cosine 0
    keys = basis[:t].clone() * torch.linspace(0.5, 3.0, t)[:, None]  # norms must not matter
    keys[dup] = basis[30] * torch.tensor([1.0, 2.0, 0.3])[:, None]  # three copies, different lengths
    keys = keys[None].repeat(2, 1, 1)  # two KV heads
    r = redundancy(keys)
    for h in range(2):
        assert set(torch.argsort(r[h], descending=True)[:3].tolist()) == set(dup)
        torch.testing.assert_close(r[h].sum(), torch.tensor(1.0))
    # through the method: with lam = 0 the score is -redundancy, and the copies are evicted first
    method = build_method("rkv", {"lam": 0.0, "window": 2})
    method.reset(_info(n_layers=1, n_heads=2, n_kv_heads=2, head_dim=d))
    q = torch.zeros(2, 2, d)  # uniform attention: importance carries no information
    method.observe(_obs([t - 2, t - 1], queries=[q], n_layers=1))
    scores = method.score(_view([keys], current=t - 1))
    for h in range(2):
        finite = scores[0, h][: t - 2]
        assert set(torch.argsort(finite)[:3].tolist()) == set(dup)
        assert torch.isinf(scores[0, h][t - 2 :]).all()  # the observation window is kept


# -- LagKV: numpy on random K/V ---------------------------------------------------------------------


def np_lag_kv(keys: list[np.ndarray], values: list[np.ndarray], lag: int, eps: float) -> np.ndarray:
    def side(layers):
        x = np.mean(layers, axis=0)  # [H, T, d]
        h, t, _ = x.shape
        out = np.zeros((h, t))
        for head in range(h):
            for i in range(t):
                c = i // lag
                v = x[head, i]
                if c > 0:
                    ref = x[head, (c - 1) * lag : c * lag]
                    v = (v - ref.min(0)) / (ref.max(0) - ref.min(0) + eps)
                out[head, i] = np.std(v, ddof=1)
        return out.mean(axis=0)

    return side(keys) + side(values)


@pytest.mark.parametrize("t", [5, 16, 37])
def test_lag_kv_matches_numpy(t):
    rng = np.random.default_rng(t)
    keys = [rng.normal(size=(3, t, 8)) * rng.uniform(0.5, 2, size=(1, t, 1)) for _ in range(4)]
    values = [rng.normal(size=(3, t, 8)) + 1.0 for _ in range(4)]
    method = build_method("lag_kv", {"lag": 8})
    method.reset(_info(n_layers=4, n_kv_heads=3))
    as_t = lambda xs: [torch.tensor(x, dtype=torch.float32) for x in xs]  # noqa: E731
    got = method.score(_view(as_t(keys), as_t(values)))
    np.testing.assert_allclose(got.numpy(), np_lag_kv(keys, values, 8, 1e-9), rtol=1e-4, atol=1e-5)


# -- epikv_seg and thinkv: quota structure on constructed inputs ---------------------------------------


def test_epikv_seg_keeps_tertile_quotas_ranked_by_epikv_score():
    seg, n, recent = 8, 6 * 8 + 4, 4
    method = build_method(
        "epikv_seg",
        {
            "segment": seg,
            "quotas": (4, 2, 1),
            "recent_window": recent,
            "layer_a": 0,
            "layer_b": 1,
            "window": 4,
            "selection": "fill",
        },
    )
    method.reset(_info(n_layers=3, n_kv_heads=1))  # layer 1 is not the last: no final norm
    rng = np.random.default_rng(3)
    # key variance per segment: segments 0..5 get spreads [5, 1, 3, 0.5, 4, 2] -> tertiles H L M L H M
    spread = np.repeat([5.0, 1.0, 3.0, 0.5, 4.0, 2.0, 1.0], seg)[:n]
    keys = torch.tensor(rng.normal(size=(1, n, 16)) * spread[None, :, None], dtype=torch.float32)
    hidden = torch.tensor(rng.normal(size=(n, 8)).cumsum(0), dtype=torch.float32)
    method.observe(
        _obs(
            list(range(n)),
            {0: hidden, 1: hidden * 0.5 + torch.tensor(rng.normal(size=(n, 8)), dtype=torch.float32)},
            keys=[keys, keys],
            n_layers=2,
            n_kv=1,
        )
    )
    scores = method.score(_view([keys, keys], budget=20, current=n - 1))
    base = method.token_scores(_view([keys], current=n - 1)).numpy()
    quota = {0: 4, 4: 4, 2: 2, 5: 2, 1: 1, 3: 1}
    tier1 = set()
    for s, q in quota.items():
        members = list(range(s * seg, (s + 1) * seg))
        best = sorted(members, key=lambda p: -base[p])[:q]
        tier1 |= set(best)
    in_recent = set(range(n - recent, n))
    ranked = torch.argsort(scores, descending=True).tolist()
    assert set(ranked[: len(in_recent)]) == in_recent
    assert set(ranked[len(in_recent) : len(in_recent) + len(tier1)]) == tier1
    rest = ranked[len(in_recent) + len(tier1) :]
    assert rest == sorted(rest, key=lambda p: -base[p])  # tier 0 ordered by the epikv score


def test_thinkv_thought_quotas():
    from kvleague.methods.thinkv import thought_quotas

    schedule = (64, 32, 16, 8, 4)
    #           oldest ......................................... newest
    types = ["R", "R", "E", "T", "E", "R", "R", "T", "E", "R", "E", "E"]
    q = thought_quotas(types, schedule)
    # newest thought E,E (age 0) -> 64; R (age 1) -> 32; E (age 2) -> 16; T; R,R (age 3) -> 8;
    # E (age 4) -> 4; T; E (age 5) -> 4; R,R (age 6) -> 4
    assert q == [4, 4, 4, None, 4, 8, 8, None, 16, 32, 64, 64]


def test_thinkv_classifies_segments_by_sparsity_and_protects_transitions():
    seg, n_kv, layers = 4, 1, 1
    method = build_method("thinkv", {"segment": seg, "keep_schedule": (2, 1), "thresholds": (0.5, 0.8)})
    method.reset(_info(n_layers=layers, n_heads=1, n_kv_heads=n_kv))
    prompt = 4
    method.observe(
        _obs(
            list(range(prompt)), attention=[torch.full((1, 1, prompt), 1 / prompt)], phase="prefill", n_layers=1, n_kv=1
        )
    )
    # segment kinds by construction: dense (R), very sparse (T), medium (E), dense (R), then an open segment
    kinds = ["R", "T", "E", "R"]
    rng = np.random.default_rng(0)
    for p in range(prompt, prompt + 4 * seg + 2):
        t = p + 1
        kind = kinds[(p - prompt) // seg] if p - prompt < 4 * seg else "R"
        if kind == "R":
            row = torch.full((t,), 1.0 / t)
        else:
            k = 1 if kind == "T" else max(1, int(0.35 * t))  # T: all mass on 1 slot; E: on ~35% of slots
            row = torch.full((t,), 1e-9)
            row[torch.tensor(rng.choice(t, k, replace=False))] = 1.0
            row /= row.sum()
        method.observe(_obs([p], attention=[row[None, None]], n_layers=1, n_kv=1))
    n = prompt + 4 * seg + 2
    is_prompt = torch.arange(n) < prompt
    view = _view([torch.zeros(1, n, 2)], is_prompt=is_prompt, current=n - 1, budget=10)
    assert method.segment_types(4) == kinds
    scores = method.score(view)
    tiers = torch.floor(scores).long().tolist()
    gen = lambda s: range(prompt + s * seg, prompt + (s + 1) * seg)  # noqa: E731
    assert [tiers[p] for p in range(n - 2, n)] == [3, 3]  # the open segment
    assert all(tiers[p] == 2 for p in gen(1))  # transition: protected whole
    # thoughts newest first: R (seg 3, age 0) -> 2 kept; E (seg 2, age 1) -> 1; R (seg 0, age 2) -> 1
    assert sum(tiers[p] == 1 for p in gen(3)) == 2
    assert sum(tiers[p] == 1 for p in gen(2)) == 1
    assert sum(tiers[p] == 1 for p in gen(0)) == 1
    assert all(tiers[p] == 0 for p in range(prompt))


# -- stretch methods: RaaS, LazyEviction, Scissorhands -------------------------------------------------


def _row_obs(position, weights, n_layers=2):
    """A decode observation at ``position`` whose (every layer, every head) attention row is ``weights``."""
    row = torch.tensor(weights, dtype=torch.float32)[None, None].expand(2, 1, -1)
    return _obs([position], attention=[row] * n_layers, n_layers=n_layers, n_kv=1)


def test_raas_and_lazy_eviction_track_attention_hits():
    raas = build_method("raas")
    lazy = build_method("lazy_eviction")
    for m in (raas, lazy):
        m.reset(_info(n_layers=2, n_heads=2, n_kv_heads=1))
    # positions 0..3 arrive as a prompt (last query attends uniformly: no hit above 1/n)
    prompt = _obs([0, 1, 2, 3], attention=[torch.full((2, 1, 4), 0.25)] * 2, phase="prefill", n_layers=2, n_kv=1)
    hits = {4: [1], 5: [], 6: [1, 3], 7: [], 8: [], 9: [1], 10: []}  # which keys get a weight above uniform
    for m in (raas, lazy):
        m.observe(prompt)
    for p, keys in hits.items():
        n = p + 1
        w = [0.1 / n] * n
        for k in keys:
            w[k] = 0.9 / len(keys) + 0.1 / n
        for m in (raas, lazy):
            m.observe(_row_obs(p, w))
    view = _view([torch.zeros(1, 11, 2)], current=10)
    # RaaS: stamp = last hit, else own position
    expected_stamp = [0, 9, 2, 6, 4, 5, 6, 7, 8, 9, 10]
    assert raas.score(view).tolist() == expected_stamp
    # LazyEviction: key 1 hit at 4, 6, 9 (gaps from its birth 1: 3, 2, 3 -> mri 3, last 9): 3 - (10 - 9) = 2
    # key 3 hit at 6 (gap 3 from birth, last 6): 3 - 4 = -1; others: 0 - (10 - own position)
    expected = [0 - 10, 2, 0 - 8, -1] + [0 - (10 - p) for p in range(4, 11)]
    assert lazy.score(view).tolist() == expected


def test_scissorhands_counts_unimportant_occurrences():
    torch.manual_seed(1)
    n_layers, h_q, h_kv, d, t, w = 1, 4, 2, 8, 12, 3
    method = build_method("scissorhands", {"history": w})
    method.reset(_info(n_layers=n_layers, n_heads=h_q, n_kv_heads=h_kv, head_dim=d))
    q = torch.randn(h_q, 5, d)
    obs = _obs(list(range(t - 5, t)), queries=[q], n_layers=n_layers, n_kv=h_kv)
    method.observe(obs)
    keys = torch.randn(h_kv, t, d)
    scores = method.score(_view([keys], current=t - 1))
    qn, kn = q[:, -w:].double().numpy(), keys.double().numpy()
    group = h_q // h_kv
    for h in range(h_kv):
        for k in range(t):
            count, total = 0, 0.0
            for i, qpos in enumerate(range(t - w, t)):
                weights = []
                for head in range(h * group, (h + 1) * group):
                    logits = kn[h, : qpos + 1] @ qn[head, i] / np.sqrt(d)
                    e = np.exp(logits - logits.max())
                    weights.append(e / e.sum())
                mean = np.mean(weights, axis=0)
                if k <= qpos:
                    total += mean[k]
                    count += mean[k] < 1.0 / (qpos + 1)
            assert float(scores[0, h, k]) == pytest.approx(-count + total / w, abs=1e-5)


def test_scissorhands_query_whose_earlier_keys_were_all_evicted_counts_for_nothing():
    """A window query at position 2 after positions 0-2 were evicted sees no cached key: its
    attention row is zeros (it finds no key unimportant and gives no weight), not NaN."""
    torch.manual_seed(2)
    h_q, h_kv, d, w = 4, 2, 8, 3
    method = build_method("scissorhands", {"history": w})
    method.reset(_info(n_layers=1, n_heads=h_q, n_kv_heads=h_kv, head_dim=d))
    q = torch.randn(h_q, w, d)
    method.observe(_obs([2, 9, 10], queries=[q], n_layers=1, n_kv=h_kv))
    keys = torch.randn(h_kv, 5, d)
    view = _view([keys], positions=[3, 5, 7, 9, 10])
    scores = method.score(view)
    assert torch.isfinite(scores).all()
    later = build_method("scissorhands", {"history": 2})  # the window without the blind query
    later.reset(_info(n_layers=1, n_heads=h_q, n_kv_heads=h_kv, head_dim=d))
    later.observe(_obs([9, 10], queries=[q[:, 1:]], n_layers=1, n_kv=h_kv))
    expected = later.score(view)
    # same unimportance counts; the mean weight is over 3 queries instead of 2, the blind one adding 0
    torch.testing.assert_close(scores, expected.floor() + (expected - expected.floor()) * 2 / 3)


def test_position_table_write_one_is_write_and_a_copy_is_its_own():
    """``write_one`` (the batched decode path) stores what ``write`` stores, grows past the end, and a
    copied table (``copy.deepcopy``) writes into its own memory, never the original's."""
    import copy

    from kvleague.methods.kernels import PositionTable

    one, many = PositionTable(fill=float("inf")), PositionTable(fill=float("inf"))
    for position, value in ((3, 0.1), (5000, -2.5), (7, 1e-300)):
        one.write_one(position, value)
        many.write(torch.tensor([position]), torch.tensor([value], dtype=torch.float64))
    assert torch.equal(one.data, many.data) and one.read(torch.tensor([3, 4, 5000, 9000])).tolist() == [
        0.1,
        float("inf"),
        -2.5,
        float("inf"),
    ]
    twin = copy.deepcopy(one)
    twin.write_one(3, 42.0)
    assert one.read(torch.tensor([3])).item() == 0.1 and twin.read(torch.tensor([3])).item() == 42.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_by_score_then_position_is_the_sorted_order_of_score_then_position(dtype):
    """The kept slots of the authors' ports (ThinKV's, EpiKV-Seg's quotas): the ``k`` highest scores,
    equal scores (many here, -0.0 and 0.0 among them, and infinities) the larger position first, as
    Python's ``sorted`` on (score, position) pairs, for every k."""
    from kvleague.methods.kernels import top_by_score_then_position

    generator = torch.Generator().manual_seed(7)
    values = torch.tensor([0.0, -0.0, 0.25, -1.5, float("inf"), float("-inf"), 3.0], dtype=dtype)
    for _ in range(20):
        n = int(torch.randint(1, 60, (1,), generator=generator))
        scores = values[torch.randint(0, len(values), (n,), generator=generator)]
        positions = torch.randperm(4 * n, generator=generator)[:n]
        oracle = sorted(range(n), key=lambda i: (float(scores[i]), int(positions[i])), reverse=True)
        for k in (0, 1, n // 2, n):
            assert top_by_score_then_position(scores, positions, k).tolist() == oracle[:k]
