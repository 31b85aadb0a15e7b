"""The signal study (issue 21): every signal and label against a naive re-computation on tiny models,
the pooled-rho bootstrap against scipy on explicit resamples, a planted-fact model where importance is
known by construction, and the CLI's bad input."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoModelForCausalLM

from kvleague.engine import Engine
from kvleague.engine.protocol import Protocol
from kvleague.methods.registry import build_method
from kvleague.runner.fidelity import self_traces
from kvleague.runner.models import load_engine
from kvleague.runner.models.tiny import make_tiny_model
from kvleague.runner.signals.correlation import SampleBootstrap, pooled_partial_spearman, pooled_spearman
from kvleague.runner.signals.method_panel import MethodPanel
from kvleague.runner.signals.study import (
    MEAN_FAMILIES,
    SignalOptions,
    model_signals,
    occlusion_windows,
    study_sample,
    token_labels,
    trace_windows,
)
from kvleague.tasks.base import ScoreResult
from tests.naive_attention import _rope

DATA_DIR = Path(os.environ.get("KVLEAGUE_DATA_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "data")


@dataclass
class FixedTask:
    """A task stand-in: one sample is (context ids, answer ids); correct iff the completion starts with ``expected``."""

    segments: dict
    expected: dict
    stop: tuple = ()

    def fidelity_segments(self, sample, tokenizer):
        context, answer = self.segments[sample.sample_id]
        return [(list(context), False), (list(answer), True)]

    def score(self, sample, completion):
        ok = completion.startswith(self.expected[sample.sample_id])
        return ScoreResult(correct=ok, score=float(ok), extracted=completion)


@dataclass
class FixedSample:
    sample_id: str


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("signals") / "llama", layers=2, seed=3)
    return path, load_engine(str(path), attn_implementation="eager")


# -- the signals against a naive re-computation ------------------------------------------------------


def naive_signals(path, ids: list[int], rolling: int) -> dict[str, np.ndarray]:
    """Every per-layer signal from its definition: a separately loaded model, q/k/v from the layer's
    projections, RoPE written out, per-head causal softmax, and Python loops over tokens."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    n_heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    n = len(ids)
    out: dict[str, np.ndarray] = {}
    for layer, block in enumerate(model.model.layers):
        h = hidden[layer + 1][0].double()
        diff = [0.0] + [float(torch.linalg.norm(h[t] - h[t - 1])) for t in range(1, n)]
        out[f"hs_l2_diff_l{layer}"] = np.array(diff)
        out[f"hs_l2_diff_rolling64_l{layer}"] = np.array(
            [np.mean(diff[max(0, t - rolling + 1) : t + 1]) for t in range(n)]
        )
        with torch.no_grad():
            x = block.input_layernorm(hidden[layer][0])
            q = block.self_attn.q_proj(x).view(n, n_heads, d).double()
            k = block.self_attn.k_proj(x).view(n, n_kv, d).double()
            v = block.self_attn.v_proj(x).view(n, n_kv, d).double()
        q = torch.stack([torch.stack([_rope(q[t, i], t, theta) for i in range(n_heads)]) for t in range(n)])
        k = torch.stack([torch.stack([_rope(k[t, i], t, theta) for i in range(n_kv)]) for t in range(n)])
        out[f"key_norm_l{layer}"] = np.array([np.mean([float(k[t, i].norm()) for i in range(n_kv)]) for t in range(n)])
        out[f"key_var_l{layer}"] = np.array([np.mean([float(k[t, i].var()) for i in range(n_kv)]) for t in range(n)])
        out[f"value_norm_l{layer}"] = np.array(
            [np.mean([float(v[t, i].norm()) for i in range(n_kv)]) for t in range(n)]
        )
        out[f"value_var_l{layer}"] = np.array([np.mean([float(v[t, i].var()) for i in range(n_kv)]) for t in range(n)])
        received = np.zeros((n_heads, n))
        entropy = np.zeros((n_heads, n))
        for head in range(n_heads):
            kv = head // (n_heads // n_kv)
            for t in range(n):
                logits = torch.tensor([float(q[t, head] @ k[s, kv]) / math.sqrt(d) for s in range(t + 1)])
                row = torch.softmax(logits, dim=0).numpy()
                received[head, : t + 1] += row
                full_row = np.concatenate([row, np.zeros(n - t - 1)])
                clamped = np.maximum(full_row, 1e-10)
                entropy[head, t] = -float(np.sum(clamped * np.log(clamped)))
        out[f"h2o_l{layer}"] = received.mean(0)
        out[f"attn_entropy_l{layer}"] = entropy.mean(0)
    return out


def test_every_model_signal_equals_its_naive_recomputation(tiny):
    path, engine = tiny
    ids = [int(t) for t in torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        ours = model_signals(engine.backend.analysis_pass(ids, 5), rolling=8)
    naive = naive_signals(path, ids, rolling=8)
    assert set(naive) <= set(ours)
    for name, expected in naive.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    assert ours["position"].tolist() == list(range(len(ids)))
    for family in ("key_norm", "h2o", "attn_entropy"):  # the all-layer means
        np.testing.assert_allclose(
            ours[f"{family}_mean"], (naive[f"{family}_l0"] + naive[f"{family}_l1"]) / 2, rtol=1e-4, atol=1e-5
        )


def test_occlusion_labels_equal_full_recomputation(tiny):
    """Each window's label is the answer's mean NLL after the occluded context minus the full one, computed
    here by a whole forward pass over the occluded sequence (no cache reuse); token labels take the
    largest label of the windows covering them."""
    path, engine = tiny
    gen = torch.Generator().manual_seed(2)
    context = [int(t) for t in torch.randint(0, 250, (50,), generator=gen)]
    answer = [int(t) for t in torch.randint(0, 250, (6,), generator=gen)]
    task = FixedTask({"s": (context, answer)}, {"s": "x"})
    options = SignalOptions(window=8, stride=4, rolling=8)
    result = study_sample(engine, task, FixedSample("s"), {}, options)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    pad = engine.tokenizer.pad_token_id

    def answer_nll(ctx):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx + answer])).logits[0].double()
        return float(np.mean([-torch.log_softmax(logits[len(ctx) - 1 + j], -1)[a] for j, a in enumerate(answer)]))

    base = answer_nll(context)
    assert result.answer_nll == pytest.approx(base, abs=1e-5)
    windows, start = [], 0
    while start < len(context):  # the authors' loop in scripts/label_importance.py
        windows.append((start, min(start + 8, len(context))))
        start += 4
    assert result.windows == windows
    expected = [answer_nll(context[:s] + [pad] * (e - s) + context[e:]) - base for s, e in windows]
    np.testing.assert_allclose(result.window_delta_nll, expected, atol=1e-5)
    per_token = [max(expected[i] for i, (s, e) in enumerate(windows) if s <= t < e) for t in range(len(context))]
    np.testing.assert_allclose(result.labels["occlusion_nll"], per_token, atol=1e-5)


def test_answer_flip_label_as_the_authors_define_it(tiny):
    """Only a sample answered correctly with the full context gets flip labels; a window flips when the
    greedy answer regenerated after occluding it is no longer correct (checked here by plain greedy
    decoding of the whole occluded context)."""
    path, engine = tiny
    gen = torch.Generator().manual_seed(5)
    context = [int(t) for t in torch.randint(0, 250, (24,), generator=gen)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    def greedy_text(ctx, n=3):
        ids = list(ctx)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return engine.tokenizer.decode(ids[len(ctx) :], skip_special_tokens=True)

    right, wrong = greedy_text(context), "\x00never"
    task = FixedTask({"r": (context, [1, 2]), "w": (context, [1, 2])}, {"r": right, "w": wrong})
    options = SignalOptions(window=8, stride=8, flip_label=True, flip_tokens=3)
    r = study_sample(engine, task, FixedSample("r"), {}, options)
    w = study_sample(engine, task, FixedSample("w"), {}, options)
    assert r.full_correct is True and w.full_correct is False and "answer_flip" not in w.labels
    pad = engine.tokenizer.pad_token_id
    expected = [
        int(not greedy_text(context[:s] + [pad] * (e - s) + context[e:]).startswith(right)) for s, e in r.windows
    ]
    assert r.window_flips == expected
    assert r.labels["answer_flip"].tolist() == [expected[t // 8] for t in range(24)]


def test_trace_windows_slide_over_the_trace_only_and_leave_a_later_token():
    assert trace_windows(10, 20, 8, 8) == [(10, 18), (18, 26)]  # (26, 30) has no later trace token
    assert trace_windows(10, 20, 8, 4) == [(10, 18), (14, 22), (18, 26)]  # (22, 30) and (26, 30) neither
    for prompt, trace, window, stride in ((5, 64, 32, 32), (7, 33, 32, 16), (100, 256, 32, 32), (1, 40, 6, 5)):
        windows = trace_windows(prompt, trace, window, stride)
        assert windows and all(prompt <= s < e < prompt + trace for s, e in windows)
        assert [s for s, _ in windows] == list(range(prompt, prompt + trace, stride))[: len(windows)]


def test_windows_over_the_self_trace_never_cover_the_prompt_and_label_the_later_trace(tiny):
    """Under ``trace="self"``, ``occluded="trace"``: the answer is exactly ``self_traces``' trace of the
    prompt; every window lies inside the trace; a window's label is the mean NLL of the trace tokens after
    it with the window occluded minus the same tokens' unoccluded, computed here by whole forward passes
    (no cache reuse); the signals are the whole sequence's, cut to the studied trace tokens, and the
    position control is the index in the trace."""
    path, engine = tiny
    gen = torch.Generator().manual_seed(6)
    prompt = [int(t) for t in torch.randint(3, 250, (20,), generator=gen)]
    reference = [int(t) for t in torch.randint(3, 250, (7,), generator=gen)]  # replaced by the self trace
    task = FixedTask({"s": (prompt, reference)}, {"s": "x"})
    options = SignalOptions(window=8, stride=8, rolling=8, max_tokens=30, trace="self", occluded="trace")
    result = study_sample(engine, task, FixedSample("s"), {"h2o": build_method("h2o", {})}, options)
    trace = self_traces(engine, [prompt], 30)[0]
    assert result.answer == trace and result.answer_tokens == 30 and result.context_tokens == 20
    assert result.occluded == "trace" and result.span_start == 20
    assert result.windows == [(20, 28), (28, 36), (36, 44)]  # (44, 50) has no later token
    assert all(s >= len(prompt) for s, _ in result.windows)  # the prompt is never occluded
    assert result.studied_tokens == 24 and len(result.signals["method:h2o"]) == 24

    ids = prompt + trace
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    pad = engine.tokenizer.pad_token_id

    def token_nll(seq):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].double(), -1)
        return np.array([-float(logp[t - 1, ids[t]]) for t in range(len(seq))[1:]])  # the true tokens' NLL

    base = token_nll(ids)
    expected = []
    for s, e in result.windows:
        occluded = token_nll(ids[:s] + [pad] * (e - s) + ids[e:])
        expected.append(float(occluded[e - 1 :].mean() - base[e - 1 :].mean()))  # tokens e.. (index t-1)
    np.testing.assert_allclose(result.window_delta_nll, expected, atol=1e-5)
    assert result.answer_nll == pytest.approx(base[len(prompt) - 1 :].mean(), abs=1e-5)
    np.testing.assert_allclose(result.labels["occlusion_nll"], np.repeat(expected, 8), atol=1e-5)
    with torch.no_grad():
        whole = model_signals(engine.backend.analysis_pass(ids, 1), rolling=8)
    np.testing.assert_allclose(result.signals["hs_l2_diff_rolling64_l1"], whole["hs_l2_diff_rolling64_l1"][20:44])
    assert result.signals["position"].tolist() == list(range(24))
    # the trace handed in (as the command decodes many together) is the one studied
    given = study_sample(engine, task, FixedSample("s"), {}, options, trace=trace)
    assert given.answer == trace and given.window_delta_nll == pytest.approx(result.window_delta_nll)


def test_method_scores_through_the_panel_equal_each_method_run_alone(tiny):
    """The panel hands each method what it declared; its score equals the method's in a session of its
    own (h2o: eager attention; tova: last-row attention; snapkv: queries; epikv: hidden states)."""
    path, engine = tiny
    gen = torch.Generator().manual_seed(4)
    context = [int(t) for t in torch.randint(0, 250, (30,), generator=gen)]
    answer = [int(t) for t in torch.randint(0, 250, (10,), generator=gen)]
    names = ("h2o", "tova", "snapkv", "epikv", "knorm")
    panel = MethodPanel(members={n: build_method(n, {}) for n in names})
    budget = len(context) + len(answer) + 1
    with engine.session(panel, budget, Protocol(), 0) as session:
        session.feed(context)
        session.teacher_force(answer, lambda logits, token: None)
        view = session.cache.view(20, "decode", session.next_position - 1)
        together = {n: m.score(view).clone() for n, m in panel.members.items()}
    for name in names:
        alone = build_method(name, {})
        with engine.session(alone, budget, Protocol(), 0) as session:
            session.feed(context)
            session.teacher_force(answer, lambda logits, token: None)
            expected = alone.score(session.cache.view(20, "decode", session.next_position - 1))
        torch.testing.assert_close(together[name], expected, rtol=1e-4, atol=1e-5, msg=name)


def test_a_randomised_method_draws_afresh_for_every_sample(tiny):
    """Two samples with the same tokens: ``random``'s scores differ (a seed per sample), ``knorm``'s do not."""
    _, engine = tiny
    context = list(range(40, 80))
    task = FixedTask({"a": (context, [1, 2, 3]), "b": (context, [1, 2, 3])}, {"a": "", "b": ""})
    methods = {"random": build_method("random", {}), "knorm": build_method("knorm", {})}
    a, b = (study_sample(engine, task, FixedSample(sid), methods, SignalOptions(window=8, stride=8)) for sid in "ab")
    assert not np.allclose(a.signals["method:random"], b.signals["method:random"])
    np.testing.assert_allclose(a.signals["method:knorm"], b.signals["method:knorm"])


def test_token_labels_and_windows_naive():
    windows = occlusion_windows(10, 4, 3)
    assert windows == [(0, 4), (3, 7), (6, 10), (9, 10)]
    labels = token_labels(10, windows, [0.5, -1.0, 2.0, 0.1])
    assert labels.tolist() == [0.5, 0.5, 0.5, 0.5, -1.0, -1.0, 2.0, 2.0, 2.0, 2.0]


# -- the statistics ----------------------------------------------------------------------------------


def _spy_statistic(run):
    """Run ``run()`` and return (its result, the statistic it handed scipy.stats.bootstrap)."""
    captured = {}
    original = stats.bootstrap

    def spy(data, statistic, **kwargs):
        captured["statistic"] = statistic
        return original(data, statistic, **kwargs)

    stats.bootstrap = spy
    try:
        result = run()
    finally:
        stats.bootstrap = original
    return result, captured["statistic"]


def test_pooled_rho_and_bootstrap_resamples_equal_scipy_on_explicit_resamples():
    rng = np.random.default_rng(0)
    label = [np.round(rng.normal(size=n), 1) for n in (12, 30, 7, 19)]  # rounded: ties inside and across samples
    signal = [np.round(x + rng.normal(size=len(x)), 1) for x in label]
    rho, p, pairs = pooled_spearman(signal, label)
    expected = stats.spearmanr(np.concatenate(signal), np.concatenate(label))
    assert (rho, p, pairs) == pytest.approx((expected.statistic, expected.pvalue, 68))
    boot = SampleBootstrap(label, n_resamples=200, seed=3)
    c, statistic = _spy_statistic(lambda: boot.correlate(signal))
    resamples = np.array([[0, 0, 3, 1], [2, 2, 2, 1], [3, 1, 0, 2]])
    ours = statistic(resamples)
    for row, value in zip(resamples, ours):
        explicit = stats.spearmanr(np.concatenate([signal[i] for i in row]), np.concatenate([label[i] for i in row]))
        assert value == pytest.approx(explicit.statistic, abs=1e-12)
    assert c.lo < c.rho < c.hi and c.n_samples == 4


def residual_partial_rho(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> float:
    """The naive partial Spearman: rank each pooled array, regress x's and y's ranks on z's ranks (least
    squares with an intercept), Pearson's r of the residuals."""
    rx, ry, rz = (stats.rankdata(v) for v in (x, y, z))
    design = np.column_stack([np.ones_like(rz), rz])
    ex = rx - design @ np.linalg.lstsq(design, rx, rcond=None)[0]
    ey = ry - design @ np.linalg.lstsq(design, ry, rcond=None)[0]
    return float(stats.pearsonr(ex, ey).statistic)


def test_partial_rho_and_its_resamples_equal_the_residual_recomputation():
    rng = np.random.default_rng(1)
    sizes = (14, 31, 9, 22, 17)
    position = [np.arange(n, dtype=float) for n in sizes]
    label = [np.round(-0.05 * z + rng.normal(size=len(z)), 1) for z in position]  # ties; drifts with position
    signal = [np.round(0.04 * z + 0.5 * y + rng.normal(size=len(z)), 1) for z, y in zip(position, label)]
    rho, p, pairs = pooled_partial_spearman(signal, label, position)
    cat = [np.concatenate(v) for v in (signal, label, position)]
    assert rho == pytest.approx(residual_partial_rho(*cat), abs=1e-12) and pairs == sum(sizes)
    assert 0 < p < 1e-3
    boot = SampleBootstrap(label, n_resamples=200, seed=3)
    c, statistic = _spy_statistic(lambda: boot.partial(signal, position))
    resamples = np.array([[0, 0, 3, 1, 4], [2, 2, 2, 1, 0], [4, 1, 0, 2, 4]])
    for row, value in zip(resamples, statistic(resamples)):
        explicit = [np.concatenate([v[i] for i in row]) for v in (signal, label, position)]
        assert value == pytest.approx(residual_partial_rho(*explicit), abs=1e-10)
    assert c.rho == rho and c.lo < c.rho < c.hi and c.n_samples == 5


def test_position_plus_noise_has_no_partial_rho_and_a_planted_signal_keeps_its_rho():
    rng = np.random.default_rng(5)
    position = [np.arange(n, dtype=float) for n in rng.integers(60, 120, 20)]
    planted = [rng.normal(size=len(z)) for z in position]  # the content that matters, independent of position
    label = [x - 0.03 * z + 0.5 * rng.normal(size=len(z)) for x, z in zip(planted, position)]
    position_like = [-z + 10 * rng.normal(size=len(z)) for z in position]  # position plus noise
    boot = SampleBootstrap(label, n_resamples=500, seed=0)
    raw_pos, partial_pos = boot.correlate(position_like), boot.partial(position_like, position)
    raw_planted, partial_planted = boot.correlate(planted), boot.partial(planted, position)
    print(
        f"position-like raw {raw_pos.rho:+.3f}, partial {partial_pos.rho:+.3f} [{partial_pos.lo:+.3f}, "
        f"{partial_pos.hi:+.3f}]; planted raw {raw_planted.rho:+.3f}, partial {partial_planted.rho:+.3f}"
    )
    assert raw_pos.rho > 0.3 and raw_pos.lo > 0  # position alone looks like a signal ...
    assert abs(partial_pos.rho) < 0.05 and partial_pos.lo < 0 < partial_pos.hi  # ... and is none with position fixed
    assert raw_planted.rho > 0.3 and partial_planted.lo > 0.3
    assert partial_planted.rho >= raw_planted.rho - 0.02  # holding position fixed removes nothing from it


# -- a planted fact: importance known by construction ------------------------------------------------

PLANTED = range(200, 216)  # the token ids of the planted fact
ANSWER = 220  # the answer token, predictable from the fact


def planted_fact_model(root) -> Engine:
    """A random llama in which the answer token is predictable only while the planted fact is visible.

    Every embedding gets a constant coordinate 0, the planted ids a large coordinate 1, and coordinate 2
    is left empty. In each layer W_q reads coordinate 0 and W_k coordinate 1 into the head's slowest
    RoPE pair (position barely rotates it), so every query's score is large for a planted key and zero
    for any other; W_v copies coordinate 1 into each head's first value dimension and W_o writes that
    into coordinate 2, which only the answer token's row of the LM head reads. While any planted token
    is visible, coordinate 2 is large and the answer is likely; occluding the whole fact removes it."""
    path = make_tiny_model("llama", root, layers=2, seed=7)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    slow = d // 2 - 1
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 3.0
        emb[:, 1:3] = 0.0
        emb[list(PLANTED), 1] = 8.0
        for block in model.model.layers:
            attn = block.self_attn
            attn.q_proj.weight.zero_()
            attn.k_proj.weight.zero_()
            attn.o_proj.weight[:3].zero_()
            block.mlp.down_proj.weight[:3].zero_()
            for head in range(cfg.num_attention_heads):
                attn.q_proj.weight[head * d + slow, 0] = 2.0
                attn.o_proj.weight[2, head * d] = 1.0
            for head in range(cfg.num_key_value_heads):
                attn.k_proj.weight[head * d + slow, 1] = 2.0
                attn.v_proj.weight[head * d] = 0.0
                attn.v_proj.weight[head * d, 1] = 1.0
        model.lm_head.weight[ANSWER] = 0.0
        model.lm_head.weight[ANSWER, 2] = 10.0
    model.save_pretrained(path)
    return load_engine(str(path), attn_implementation="eager")


def test_planted_fact_is_found_and_a_random_signal_is_not(tmp_path):
    engine = planted_fact_model(tmp_path / "planted")
    rng = np.random.default_rng(11)
    segments, expected, starts = {}, {}, {}
    for i in range(10):
        context = [int(t) for t in rng.integers(0, 200, 128)]
        start = int(rng.choice([16, 32, 48, 64, 80]))
        fact = [int(t) for t in rng.choice(list(PLANTED), 32)]
        context[start : start + 32] = fact
        segments[f"s{i}"] = (context, [ANSWER] * 16)
        expected[f"s{i}"] = ""
        starts[f"s{i}"] = start
    task = FixedTask(segments, expected)
    options = SignalOptions()  # the defaults: window 32, stride 16
    studied = [study_sample(engine, task, FixedSample(sid), {}, options) for sid in segments]
    for s in studied:  # the occlusion label peaks exactly on the planted window
        best = s.windows[int(np.argmax(s.window_delta_nll))]
        assert best == (starts[s.sample_id], starts[s.sample_id] + 32), (s.sample_id, s.window_delta_nll)
    labels = [s.labels["occlusion_nll"] for s in studied]
    boot = SampleBootstrap(labels, n_resamples=1000, seed=0)
    indicator = []
    for s in studied:
        mark = np.zeros(s.context_tokens)
        mark[starts[s.sample_id] : starts[s.sample_id] + 32] = 1.0
        indicator.append(mark)
    built = boot.correlate(indicator)
    key_norm = boot.correlate([s.signals["key_norm_mean"] for s in studied])  # the construction puts the fact in K
    noise = boot.correlate([np.random.default_rng(100 + i).random(s.context_tokens) for i, s in enumerate(studied)])
    print(
        f"planted indicator rho {built.rho:+.3f} [{built.lo:+.3f}, {built.hi:+.3f}]; key_norm_mean rho "
        f"{key_norm.rho:+.3f} [{key_norm.lo:+.3f}, {key_norm.hi:+.3f}]; random rho {noise.rho:+.3f} [{noise.lo:+.3f}, {noise.hi:+.3f}]"
    )
    assert built.rho > 0.5 and built.lo > 0.5
    assert key_norm.rho > 0.5
    assert noise.lo < 0 < noise.hi


# -- the command line ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--window", "0"], "window"),
        (["--stride", "-3"], "stride"),
        (["--trace", "sampled"], "--trace"),
        (["--limit", "0"], "limit"),
        (["--score-budget-fraction", "1.5"], "score-budget-fraction"),
        (["--bootstrap", "10"], "bootstrap"),
        (["--max-seconds", "0"], "max-seconds"),
        (["--occlude", "sideways"], "--occlude"),
        (["--occlude", "trace", "--flip-label"], "flip-label"),
        (["--occlude", "trace", "--max-tokens", "32"], "max-tokens"),
        (["--trace", "self", "--trace-batch", "0"], "trace-batch"),
    ],
)
def test_bad_input_is_one_line_naming_the_field_exit_2(capsys, argv, field):
    from kvleague.cli import main

    assert main(["signals", "--task", "math500", "--no-store", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err


def test_cli_stores_every_correlation_with_provenance(tiny, tmp_path):
    """A run on a real task stores one row per (label, signal), each with the run's options and the
    environment (git commit, library versions); the stored rho equals the JSON report's."""
    import json

    from sqlalchemy import select

    from kvleague.cli import main
    from kvleague.db.models import Environment, SignalCorrelation
    from kvleague.db.session import get_engine

    if not (DATA_DIR / "paul_graham_essays").is_dir():
        pytest.skip(f"no NIAH haystack under {DATA_DIR}")
    path, _ = tiny
    url = f"sqlite:///{tmp_path / 'signals.db'}"
    out = tmp_path / "signals.json"
    argv = [
        "signals",
        "--model",
        str(path),
        "--task",
        "niah",
        "--option",
        "context_length=160",
        "--limit",
        "2",
        "--max-tokens",
        "8",
        "--method",
        "h2o",
        "--method",
        "random",
        "--bootstrap",
        "200",
        "--data-dir",
        str(DATA_DIR),
        "--json",
        str(out),
        "--db",
        url,
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    with get_engine(url).connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(SignalCorrelation.__table__))]
        env = dict(conn.execute(select(Environment.__table__)).one()._mapping)
    assert (
        len(rows) == len(report["correlations"]) == 8 * 2 + 6 + 1 + 2
    )  # 8 families x 2 layers, 6 all-layer means, position, 2 methods
    stored = {(r["label"], r["signal"]): r for r in rows}
    for c in report["correlations"]:
        r = stored[(c["label"], c["signal"])]
        assert r["rho"] == (pytest.approx(c["rho"]) if math.isfinite(c["rho"]) else None)
    row = stored[("occlusion_nll", "h2o_l1")]
    assert (row["family"], row["layer"], row["n_layers"], row["domain"], row["n_samples"]) == ("h2o", 1, 2, "longqa", 2)
    assert row["config"]["options"]["window"] == 32 and row["config"]["task_options"]["context_length"] == 160
    assert stored[("occlusion_nll", "method:random")]["family"] == "method"
    # intervals by default for the paper's per-layer signal, the all-layer signals and the methods only
    assert row["rho_lo"] is None and row["rho_hi"] is None
    for name in ("hs_l2_diff_rolling64_l0", "h2o_mean", "position", "method:h2o"):
        assert stored[("occlusion_nll", name)]["rho_lo"] < stored[("occlusion_nll", name)]["rho_hi"], name
    # and, but for position itself, the rho with position held fixed, as the JSON report has it
    partial = {(c["label"], c["signal"]): c for c in report["correlations"] if "control" in c}
    assert {s for _, s in partial} == {
        "hs_l2_diff_rolling64_l0",
        "hs_l2_diff_rolling64_l1",
        "method:h2o",
        "method:random",
    } | {f"{f}_mean" for f in MEAN_FAMILIES}
    for key, r in stored.items():
        if key in partial:
            c = partial[key]
            assert r["control"] == "position" and r["partial_rho"] == pytest.approx(c["partial_rho"])
            assert r["partial_lo"] < r["partial_hi"], key  # (two samples: a resample is one of three)
        else:
            assert r["control"] is None and r["partial_rho"] is None, key
    assert env["git_commit"] and env["torch_version"] == torch.__version__
    assert main(argv[:-2] + ["--db", url, "--no-store"]) == 0  # (a second run, not stored: the table is unchanged)
    with get_engine(url).connect() as conn:
        assert len(conn.execute(select(SignalCorrelation.__table__)).all()) == len(rows)


def test_cli_trace_setting_stores_rows_tagged_with_it_over_the_self_traces(tiny, tmp_path):
    """``--trace self --occlude trace``: each sample's answer is ``self_traces``' trace of its prompt (decoded
    alone here, in batches of two there), every window lies in the trace, and every stored row says
    ``occluded = trace``; a default run beside it stays ``context`` and the tables read both."""
    import json

    from sqlalchemy import select

    from kvleague.analysis.signal_tables import read_correlations, setting_comparison
    from kvleague.cli import main
    from kvleague.db.models import SignalCorrelation
    from kvleague.db.session import get_engine
    from kvleague.runner.fidelity import prompt_ids
    from kvleague.runner.reference_tasks import load_samples, reference_task

    if not (DATA_DIR / "paul_graham_essays").is_dir():
        pytest.skip(f"no NIAH haystack under {DATA_DIR}")
    path, engine = tiny
    url = f"sqlite:///{tmp_path / 'signals.db'}"
    common = [
        "signals",
        "--model",
        str(path),
        "--task",
        "niah",
        "--option",
        "context_length=160",
        "--limit",
        "3",
        "--method",
        "h2o",
        "--bootstrap",
        "200",
        "--data-dir",
        str(DATA_DIR),
        "--db",
        url,
    ]
    out = tmp_path / "trace.json"
    assert (
        main(
            [
                *common,
                "--trace",
                "self",
                "--occlude",
                "trace",
                "--max-tokens",
                "24",
                "--window",
                "8",
                "--stride",
                "8",
                "--trace-batch",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert main([*common, "--max-tokens", "8"]) == 0
    report = json.loads(out.read_text())
    task = reference_task("niah", ["context_length=160"], "")
    samples = {s.sample_id: s for s in load_samples(task, engine.tokenizer, 3, 0, str(DATA_DIR))}
    assert len(report["samples"]) == 3
    for s in report["samples"]:
        prompt = prompt_ids(task.fidelity_segments(samples[s["sample_id"]], engine.tokenizer))
        assert s["answer_ids"] == self_traces(engine, [prompt], 24)[0]
        assert s["context_tokens"] == len(prompt) == s["span_start"]
        assert s["windows"] == [[len(prompt) + i, len(prompt) + i + 8] for i in (0, 8)]
        assert s["studied_tokens"] == 16
    with get_engine(url).connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(SignalCorrelation.__table__))]
    by_run = {}
    for r in rows:
        by_run.setdefault(r["run_id"], set()).add(r["occluded"])
    assert sorted(map(sorted, by_run.values())) == [["context"], ["trace"]]
    trace_rows = [r for r in rows if r["run_id"] == report["run_id"]]
    assert {r["occluded"] for r in trace_rows} == {"trace"} and len(trace_rows) == len(report["correlations"])
    assert (
        trace_rows[0]["config"]["options"]["occluded"] == "trace"
        and trace_rows[0]["config"]["options"]["trace"] == "self"
    )
    df = read_correlations(get_engine(url))
    assert set(df["occluded"]) == {"context", "trace"}  # the latest run of each setting, not of each task
    comparison = setting_comparison(df)
    assert set(comparison["signal"]) >= {"h2o_mean", "key_norm_mean", "position"}


def test_summary_says_too_few_samples_instead_of_nan_and_keys_its_columns(capsys):
    """Two samples or one (``signals --limit 2``): a constant signal has no rho, one sample no interval,
    and two give intervals from few distinct resamples; the summary says so in words, with no NaN, no
    scipy warning, and a key for its columns (issue 50)."""
    import dataclasses
    import warnings

    import numpy as np

    from kvleague.runner.signals.commands import _print_summary
    from kvleague.runner.signals.correlation import SampleBootstrap

    rng = np.random.default_rng(0)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what scipy says of degenerate resamples stays out of the output
        for n, signal in ((2, "noisy"), (2, "constant"), (1, "noisy")):
            labels = [rng.normal(size=6) for _ in range(n)]
            values = [x + rng.normal(size=6) if signal == "noisy" else np.ones(6) for x in labels]
            c = SampleBootstrap(labels, 200, 0).correlate(values)
            rows.append({"label": f"{signal}-{n}", "signal": "position", **dataclasses.asdict(c)})
    _print_summary(rows)
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    lines = out.splitlines()
    assert "too few samples" in lines[1] and "no interval: too few samples" in lines[2]
    assert "[" in lines[0] and "too few" not in lines[0]
    assert lines[3].startswith("key: rho:") and lines[4].startswith("note: n=1 samples")
