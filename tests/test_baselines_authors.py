"""The authors' baselines and EpiKV-Seg against naive re-implementations of the authors' semantics.

Each oracle below follows one class of stevenkolawole/epiphany-kv-cache ``src/eviction.py`` under its
``scripts/benchmark.py`` loop, written from the class's description, independently of kvleague's
code: a plain HF decode loop (no ``position_ids``: positions follow the cache length), the authors'
per-step rule over Python lists, and equal scores broken towards the more recent position (kvleague's
stated rule; the authors' ``topk`` leaves it open). kvleague runs the same prompt through its engine;
kept positions after every decode forward and the greedy tokens must be identical, over 100+
evictions on tiny Llama / Qwen2 / Qwen3 models (float32; eager attention where the class reads
attention). Each documented choice has a mutation: the oracle with that choice changed must differ.

Also here: the engine's "keep fewer than B" contract (a -inf score means must-drop).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kvleague.engine.contract import EvictionMethod, Needs
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from tests.conftest import ARCHS
from tests.test_epikv_reference import _prompt, _z, keep_only, kvleague_decode, oracle_decode

COMPACT = Protocol(positions="compact")
PAPER = Protocol.preset("epikv_paper")
PROMPT, BUDGET, STEPS = 30, 48, 122  # every-step regimes: 104 decode forwards above B


@pytest.fixture(scope="module")
def models(tiny_models):
    """``(arch, attn_implementation) -> float32 HF model``."""
    return {
        (arch, impl): AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation=impl
        ).eval()
        for arch, path in tiny_models.items()
        for impl in ("eager", "sdpa")
    }


def oracle_loop(model, prompt, n_new, policy):
    """The authors' harness loop; ``policy.step`` returns the positions to keep (or None) after each forward."""
    wants = dict(use_cache=True, output_attentions=policy.attentions, output_hidden_states=policy.hidden)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), **wants)
    cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    policy.start(len(prompt), out)
    positions, tokens, kept = list(range(len(prompt))), [], []
    for step in range(n_new):
        tokens.append(token)
        with torch.no_grad():
            out = model(torch.tensor([[token]]), past_key_values=cache, **wants)
        cache = out.past_key_values
        positions.append(len(prompt) + step)
        keep = policy.step(out, cache, positions)
        if keep is not None:
            positions = keep_only(cache, positions, keep)
        kept.append(list(positions))
        token = int(out.logits[0, -1].argmax())
    return tokens, kept


def assert_as_the_authors(engine, model, prompt, steps, method, protocol, oracle, mutations=None):
    """kvleague's kept positions after every decode forward and its greedy tokens equal ``oracle``'s over
    100+ evictions; each of ``mutations`` (an oracle with one documented choice changed) differs.
    Returns kvleague's run and the oracle's ``(tokens, kept)``."""
    expected = oracle_loop(model, prompt, steps, oracle)
    got = kvleague_decode(engine, prompt, steps, BUDGET, method, protocol)
    assert got[2] >= 100
    assert (got[0], got[1]) == expected
    for name, mutant in (mutations or {}).items():
        assert oracle_loop(model, prompt, steps, mutant) != expected, name
    return got, expected


def best(candidates, score, k):
    """The ``k`` candidates of highest ``score``; equal scores: the larger position first."""
    return sorted(candidates, key=lambda p: (score[p], p), reverse=True)[: max(k, 0)]


def newest_row(attentions, layers=None):
    """Mean over the given layers of the newest query's attention row, each averaged over heads."""
    chosen = attentions if layers is None else attentions[-layers:]
    return torch.stack([a[0, :, -1].mean(dim=0) for a in chosen]).mean(dim=0)


def tertiles(values, descending=False, strict=False):
    """0/1/2 per value by thresholds sorted[S // 3], sorted[2S // 3] (one value: 0)."""
    n = len(values)
    if n == 1:
        return [0]
    low, high = sorted(values)[n // 3], sorted(values)[2 * n // 3]
    if descending:
        above = (lambda v, t: v > t) if strict else (lambda v, t: v >= t)
        return [0 if above(v, high) else 1 if above(v, low) else 2 for v in values]
    below = (lambda v, t: v < t) if strict else (lambda v, t: v <= t)
    return [0 if below(v, low) else 1 if below(v, high) else 2 for v in values]


class Policy:
    attentions = False
    hidden = False

    def start(self, n_prompt, out):
        self.n_prompt = n_prompt


# -- ThinKVEviction ----------------------------------------------------------------------------------


class ThinKVOracle(Policy):
    attentions = True

    def __init__(
        self,
        budget,
        segment=128,
        quotas=(64, 32, 8),
        fill=False,
        strict=False,
        classifier_layers=4,
        rank_all_layers=False,
    ):
        self.budget, self.segment, self.quotas = budget, segment, quotas
        self.fill, self.strict, self.classifier_layers, self.rank_all_layers = (
            fill,
            strict,
            classifier_layers,
            rank_all_layers,
        )

    def step(self, out, cache, positions):
        b = self.budget
        if len(positions) <= b:
            return None
        recent = min(128, b // 4)
        c = len(positions) - recent
        entropy_row = newest_row(out.attentions, self.classifier_layers)
        rank_row = newest_row(out.attentions) if self.rank_all_layers else out.attentions[-1][0, :, -1].mean(dim=0)
        segments = [list(range(s, min(s + self.segment, c))) for s in range(0, c, self.segment)]
        entropies = []
        for seg in segments:
            a = entropy_row[seg]
            p = a / (a.sum() + 1e-9)
            entropies.append(float(-(p * torch.log(p + 1e-12)).sum()))
        keep, left = set(positions[c:]), b - recent
        score = {positions[i]: float(rank_row[i]) for i in range(c)}
        for seg, kind in zip(segments, tertiles(entropies, strict=self.strict)):
            if left <= 0:
                break
            n = min(self.quotas[kind], len(seg), left)
            keep |= set(best([positions[i] for i in seg], score, n))
            left -= n
        if self.fill:  # the engine's usual contract: top up to B by the ranking score
            keep |= set(best([p for p in positions[:c] if p not in keep], score, b - len(keep)))
        return keep


THINKV_MULTI = dict(segment=8, quotas=(8, 8, 7))  # 5 segments: the T quota binds, then the budget truncates


@pytest.mark.parametrize("arch", ARCHS)
def test_thinkv_authors_equals_the_authors_semantics(engines, models, monkeypatch, arch):
    monkeypatch.setattr(engines[arch], "eos_ids", set())
    prompt = _prompt(20 + ARCHS.index(arch), PROMPT)
    params = THINKV_MULTI if arch != "llama" else {}
    mutations = dict(
        strict_thresholds=ThinKVOracle(BUDGET, strict=True, **params),
        one_classifier_layer=ThinKVOracle(BUDGET, classifier_layers=1, **params),
        rank_by_all_layers=ThinKVOracle(BUDGET, rank_all_layers=True, **params),
    )
    assert_as_the_authors(
        engines[arch],
        models[arch, "eager"],
        prompt,
        STEPS,
        build_method("thinkv_authors", params),
        COMPACT,
        ThinKVOracle(BUDGET, **params),
        mutations if arch == "qwen2" else None,
    )


def test_thinkv_authors_keeps_only_the_quotas(engines, models, monkeypatch):
    """Small quotas: the cache drops far below B at each eviction, then refills to B + 1."""
    monkeypatch.setattr(engines["qwen3"], "eos_ids", set())
    prompt, params = _prompt(31, PROMPT), dict(segment=8, quotas=(4, 2, 1))
    expected = oracle_loop(models["qwen3", "eager"], prompt, STEPS, ThinKVOracle(BUDGET, **params))
    got = kvleague_decode(engines["qwen3"], prompt, STEPS, BUDGET, build_method("thinkv_authors", params), COMPACT)
    assert (got[0], got[1]) == expected
    assert got[2] >= 4 and min(len(k) for k in got[1]) <= BUDGET - 20
    # mutation: the engine's usual contract (top up to B by the ranking score) is another method
    assert oracle_loop(models["qwen3", "eager"], prompt, STEPS, ThinKVOracle(BUDGET, fill=True, **params)) != expected


# -- RaaSEviction ------------------------------------------------------------------------------------


class RaaSOracle(Policy):
    attentions = True

    def __init__(self, budget, strict=False, upper_median=False, older_wins_ties=False, recent=0):
        self.budget, self.strict, self.upper_median, self.older_wins_ties, self.recent = (
            budget,
            strict,
            upper_median,
            older_wins_ties,
            recent,
        )

    def start(self, n_prompt, out):
        super().start(n_prompt, out)
        self.stamp, self.t = {}, 0

    def step(self, out, cache, positions):
        self.t += 1
        self.stamp[positions[-1]] = self.t
        row = newest_row(out.attentions)
        generated = [i for i, p in enumerate(positions) if p >= self.n_prompt]
        values = sorted(float(row[i]) for i in generated)
        median = values[len(values) // 2 if self.upper_median else (len(values) - 1) // 2]
        for i in generated:
            if float(row[i]) > median or (not self.strict and float(row[i]) == median):
                self.stamp[positions[i]] = self.t
        if len(positions) <= self.budget:
            return None
        new = [positions[i] for i in generated]
        window = set(new[-self.recent :]) if self.recent else set()
        sign = -1 if self.older_wins_ties else 1
        ranked = sorted(new, key=lambda p: (p in window, self.stamp[p], sign * p), reverse=True)
        return set(range(self.n_prompt)) | set(ranked[: self.budget - self.n_prompt])


RAAS_PROTOCOL = Protocol(positions="compact", protect_prompt=True, prompt_over_budget="keep")


@pytest.mark.parametrize("arch", ARCHS)
def test_raas_authors_equals_the_authors_semantics(engines, models, monkeypatch, arch):
    monkeypatch.setattr(engines[arch], "eos_ids", set())
    prompt = _prompt(40 + ARCHS.index(arch), PROMPT)
    mutations = dict(
        strict_threshold=RaaSOracle(BUDGET, strict=True),
        upper_median=RaaSOracle(BUDGET, upper_median=True),
        older_wins_ties=RaaSOracle(BUDGET, older_wins_ties=True),
        recent_window=RaaSOracle(BUDGET, recent=8),
    )
    assert_as_the_authors(
        engines[arch],
        models[arch, "eager"],
        prompt,
        STEPS,
        build_method("raas_authors"),
        RAAS_PROTOCOL,
        RaaSOracle(BUDGET),
        mutations if arch == "llama" else None,
    )


# -- RKVEviction -------------------------------------------------------------------------------------


class RKVOracle(Policy):
    attentions = True

    def __init__(self, budget, buffer=1, pooling="max", standardised=True, window=8, lam=0.1):
        self.budget, self.buffer, self.pooling, self.standardised, self.window, self.lam = (
            budget,
            buffer,
            pooling,
            standardised,
            window,
            lam,
        )

    def start(self, n_prompt, out):
        super().start(n_prompt, out)
        self.rows = []

    def step(self, out, cache, positions):
        self.rows = (self.rows + [dict(zip(positions, newest_row(out.attentions).tolist()))])[-self.window :]
        if len(positions) < self.budget + self.buffer:
            return None
        observed = torch.tensor([[row.get(p, 0.0) for p in positions] for row in self.rows])
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        importance = pool(observed[:, None], 7, stride=1, padding=3)[:, 0].mean(dim=0)
        per_layer = []
        for layer in cache.layers:
            k = layer.keys[0]  # [H, T, d]
            unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
            similarity = ((unit @ unit.transpose(1, 2)).sum(dim=-1) - 1.0) / k.shape[1]  # mean cosine, self removed
            per_layer.append(torch.softmax(similarity, dim=-1).mean(dim=0))
        redundancy = torch.stack(per_layer).mean(dim=0)
        z = (lambda x: (x - x.mean()) / (x.std() + 1e-8)) if self.standardised else (lambda x: x)
        s = self.lam * z(importance) - (1 - self.lam) * z(redundancy)
        score = {
            p: (float("inf") if i >= len(positions) - self.window else float(s[i])) for i, p in enumerate(positions)
        }
        return set(best(positions, score, self.budget))


@pytest.mark.parametrize("arch", ARCHS)
def test_rkv_authors_equals_the_authors_semantics(engines, models, monkeypatch, arch):
    """Compression whenever the cache reaches B + 1 (the authors' buffer 1 = kvleague's every_step)."""
    monkeypatch.setattr(engines[arch], "eos_ids", set())
    prompt = _prompt(50 + ARCHS.index(arch), PROMPT)
    mutations = dict(avg_pooling=RKVOracle(BUDGET, pooling="avg"), raw_mix=RKVOracle(BUDGET, standardised=False))
    assert_as_the_authors(
        engines[arch],
        models[arch, "eager"],
        prompt,
        STEPS,
        build_method("rkv_authors"),
        COMPACT,
        RKVOracle(BUDGET),
        mutations if arch == "qwen3" else None,
    )


def test_rkv_authors_buffer_is_cadence_buffer_n_minus_one(engines, models, monkeypatch):
    """The authors compress at B + buffer entries (>=); kvleague's ``buffer=N`` at B + N + 1 (>)."""
    monkeypatch.setattr(engines["llama"], "eos_ids", set())
    prompt = _prompt(55, PROMPT)
    expected = oracle_loop(models["llama", "eager"], prompt, STEPS, RKVOracle(BUDGET, buffer=8))
    method = build_method("rkv_authors")
    got = kvleague_decode(
        engines["llama"], prompt, STEPS, BUDGET, method, Protocol(positions="compact", cadence="buffer=7")
    )
    assert got[2] >= 10 and (got[0], got[1]) == expected
    later = kvleague_decode(
        engines["llama"], prompt, STEPS, BUDGET, method, Protocol(positions="compact", cadence="buffer=8")
    )
    assert (later[0], later[1]) != expected


# -- LongFlowEviction --------------------------------------------------------------------------------


class LongFlowOracle(Policy):
    attentions = True

    def __init__(self, budget, norm=1, recent=0):
        self.budget, self.norm, self.recent = budget, norm, recent

    def step(self, out, cache, positions):
        if len(positions) <= self.budget:
            return None
        row = newest_row(out.attentions)
        size = torch.stack([layer.values[0].norm(p=self.norm, dim=-1).mean(dim=0) for layer in cache.layers]).mean(
            dim=0
        )
        score = {p: float(row[i] * size[i]) for i, p in enumerate(positions)}
        for p in positions[len(positions) - self.recent :] if self.recent else []:
            score[p] = float("inf")
        return set(best(positions, score, self.budget))


@pytest.mark.parametrize("arch", ARCHS)
def test_longflow_authors_equals_the_authors_semantics(engines, models, monkeypatch, arch):
    monkeypatch.setattr(engines[arch], "eos_ids", set())
    prompt = _prompt(60 + ARCHS.index(arch), PROMPT)
    mutations = dict(l2_norm=LongFlowOracle(BUDGET, norm=2), recent_window=LongFlowOracle(BUDGET, recent=8))
    assert_as_the_authors(
        engines[arch],
        models[arch, "eager"],
        prompt,
        STEPS,
        build_method("longflow_authors"),
        COMPACT,
        LongFlowOracle(BUDGET),
        mutations if arch == "qwen2" else None,
    )


# -- KVSegHSEviction (epikv_seg) ------------------------------------------------------------------------


class HiddenScore(Policy):
    """EpiKV's frozen score of each generated token: z_A - z_B of ||h_t - h_{t-1}||, float32 (the
    authors' ``_hs_diff`` / ``_rolling_z_score``), as in tests/test_epikv_reference.py."""

    hidden = True

    def __init__(self, layer_a, layer_b, window=64):
        self.layer_a, self.layer_b, self.window = layer_a, layer_b, window

    def start(self, n_prompt, out):
        super().start(n_prompt, out)
        self.prev = {l: out.hidden_states[l + 1][0, -1] for l in (self.layer_a, self.layer_b)}
        self.series, self.score = {self.layer_a: [], self.layer_b: []}, {}

    def observe(self, out, position):
        for l in (self.layer_a, self.layer_b):
            h = out.hidden_states[l + 1][0, -1]
            self.series[l].append(float((h - self.prev[l]).norm()))
            self.prev[l] = h
        z = _z(self.series[self.layer_a], self.window) - _z(self.series[self.layer_b], self.window)
        self.score[position] = float(torch.tensor(z, dtype=torch.float32))


class KVSegOracle(HiddenScore):
    def __init__(
        self,
        budget,
        layer_a,
        layer_b,
        segment=128,
        quotas=(64, 32, 8),
        after_prompt=False,
        ascending=False,
        strict=False,
    ):
        super().__init__(layer_a, layer_b)
        self.budget, self.segment, self.quotas = budget, segment, quotas
        self.after_prompt, self.ascending, self.strict = after_prompt, ascending, strict

    def step(self, out, cache, positions):
        self.observe(out, positions[-1])
        b, p = self.budget, self.n_prompt
        if len(positions) <= b:
            return None
        recent = min(128, b // 4)
        c = len(positions) - recent
        variance = torch.stack([layer.keys[0, :, :c].var(dim=-1).mean(dim=0) for layer in cache.layers]).mean(dim=0)
        first = p if self.after_prompt else 0
        segments = [list(range(s, min(s + self.segment, c))) for s in range(first, c, self.segment)]
        kinds = tertiles(
            [float(variance[seg].mean()) for seg in segments], descending=not self.ascending, strict=self.strict
        )
        keep, left = set(range(p)) | set(positions[c:]), b - recent - p
        for seg, kind in zip(segments, kinds):
            if left <= 0:
                break
            generated = [positions[i] for i in seg if positions[i] >= p]
            if generated:
                n = min(self.quotas[kind], len(generated), left)
                keep |= set(best(generated, self.score, n))
                left -= n
        return keep


SEG_PARAMS = dict(segment=8, quotas=(8, 7, 6))


@pytest.mark.parametrize("arch", ARCHS)
def test_epikv_seg_equals_the_authors_kvseghs(engines, models, monkeypatch, arch):
    monkeypatch.setattr(engines[arch], "eos_ids", set())
    prompt = _prompt(70 + ARCHS.index(arch), 20)
    steps = 150  # some evictions keep fewer than B, so more steps for 100 evictions
    method = build_method("epikv_seg", {"layer_a": 1, "layer_b": 3, **SEG_PARAMS})
    mutations = dict(
        segments_after_the_prompt=KVSegOracle(BUDGET, 1, 3, after_prompt=True, **SEG_PARAMS),
        low_variance_first=KVSegOracle(BUDGET, 1, 3, ascending=True, **SEG_PARAMS),
        strict_thresholds=KVSegOracle(BUDGET, 1, 3, strict=True, **SEG_PARAMS),
    )
    got, expected = assert_as_the_authors(
        engines[arch],
        models[arch, "sdpa"],
        prompt,
        steps,
        method,
        PAPER,
        KVSegOracle(BUDGET, 1, 3, **SEG_PARAMS),
        mutations if arch == "llama" else None,
    )
    if arch == "llama":
        assert min(len(k) for k in got[1]) < BUDGET
        # kvleague's earlier reading (position segments, fill B) is an option and differs
        fill = build_method("epikv_seg", {"layer_a": 1, "layer_b": 3, "selection": "fill", **SEG_PARAMS})
        assert kvleague_decode(engines[arch], prompt, steps, BUDGET, fill, PAPER)[:2] != expected


# -- HSVarianceEviction --------------------------------------------------------------------------------


def _rolling_mean(series, window):
    chunk = series[-window:]
    return sum(chunk) / len(chunk)


def test_hs_variance_equals_the_authors_semantics(engines, models, monkeypatch):
    monkeypatch.setattr(engines["qwen3"], "eos_ids", set())
    prompt = _prompt(85, PROMPT)
    expected = oracle_decode(models["qwen3", "sdpa"], prompt, STEPS, BUDGET, [1], [3], window=16, signal=_rolling_mean)
    method = build_method("hs_variance", {"layer_a": 1, "layer_b": 3, "window": 16})
    got = kvleague_decode(engines["qwen3"], prompt, STEPS, BUDGET, method, PAPER)
    assert got[2] >= 100 and (got[0], got[1]) == expected
    # mutation: the detrended (z-scored) signal is EpiKV-Flat, another method
    assert oracle_decode(models["qwen3", "sdpa"], prompt, STEPS, BUDGET, [1], [3], window=16) != expected


# -- KVValVarianceEviction / KVKeyVarianceEviction / LagKVKeyVarianceEviction -----------------------


class PaperSelection(Policy):
    """The EpiKV harness's selection: prompt kept, newest min(128, B // 4) generated kept, then score."""

    def __init__(self, budget):
        self.budget = budget

    def select(self, positions, score):
        if len(positions) <= self.budget:
            return None
        generated = [p for p in positions if p >= self.n_prompt]
        recent = min(128, self.budget // 4)
        window = set(generated[-recent:])
        ranked = sorted(generated, key=lambda p: (p in window, score[p], p), reverse=True)
        return set(range(self.n_prompt)) | set(ranked[: self.budget - self.n_prompt])


class RollingVarianceOracle(PaperSelection):
    def __init__(self, budget, tensor, window=64, statistic="var", with_prompt=False):
        super().__init__(budget)
        self.tensor, self.window, self.statistic, self.with_prompt = tensor, window, statistic, with_prompt

    def _variance(self, cache, slot):
        spread = torch.var if self.statistic == "var" else torch.std
        per_layer = [float(spread(getattr(layer, self.tensor)[0, :, slot], dim=-1).mean()) for layer in cache.layers]
        return sum(per_layer) / len(per_layer)

    def start(self, n_prompt, out):
        super().start(n_prompt, out)
        self.series, self.score = [], {}
        if self.with_prompt:
            self.series = [self._variance(out.past_key_values, s) for s in range(n_prompt)]

    def step(self, out, cache, positions):
        self.series.append(self._variance(cache, -1))
        chunk = self.series[-self.window :]
        self.score[positions[-1]] = float(torch.tensor(sum(chunk) / len(chunk), dtype=torch.float32))
        return self.select(positions, self.score)


@pytest.mark.parametrize("name,tensor", [("kv_val", "values"), ("kv_key", "keys")])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_kv_variance_equals_the_authors_semantics(engines, models, monkeypatch, arch, name, tensor):
    monkeypatch.setattr(engines[arch], "eos_ids", set())
    prompt = _prompt(80 + ARCHS.index(arch), PROMPT)
    mutations = dict(
        std_instead_of_variance=RollingVarianceOracle(BUDGET, tensor, window=16, statistic="std"),
        series_with_prompt=RollingVarianceOracle(BUDGET, tensor, window=16, with_prompt=True),
    )
    assert_as_the_authors(
        engines[arch],
        models[arch, "sdpa"],
        prompt,
        STEPS,
        build_method(name, {"window": 16}),
        PAPER,
        RollingVarianceOracle(BUDGET, tensor, window=16),
        mutations if arch == "qwen2" else None,
    )


class LagKeyOracle(PaperSelection):
    def __init__(self, budget, lag):
        super().__init__(budget)
        self.lag = lag

    def step(self, out, cache, positions):
        if len(positions) <= self.budget:
            return None
        keys = torch.stack([layer.keys[0] for layer in cache.layers]).mean(dim=0)  # [H, T, d]
        score = {}
        for start in range(0, len(positions), self.lag):
            chunk = keys[:, start : start + self.lag]
            if start:
                ref = keys[:, start - self.lag : start]
                lo, hi = ref.amin(dim=1, keepdim=True), ref.amax(dim=1, keepdim=True)
                chunk = (chunk - lo) / (hi - lo + 1e-9)
            for j, s in enumerate(chunk.std(dim=-1).mean(dim=0).tolist()):
                score[positions[start + j]] = s
        return self.select(positions, score)


def test_lag_kv_key_equals_the_authors_semantics(engines, models, monkeypatch):
    monkeypatch.setattr(engines["llama"], "eos_ids", set())
    prompt = _prompt(90, PROMPT)
    expected = oracle_loop(models["llama", "sdpa"], prompt, STEPS, LagKeyOracle(BUDGET, 16))
    got = kvleague_decode(engines["llama"], prompt, STEPS, BUDGET, build_method("lag_kv_key", {"lag": 16}), PAPER)
    assert got[2] >= 100 and (got[0], got[1]) == expected
    # mutation: keys and values (lag_kv) is another rule
    both = kvleague_decode(engines["llama"], prompt, STEPS, BUDGET, build_method("lag_kv", {"lag": 16}), PAPER)
    assert (both[0], both[1]) != expected


# -- the engine's contract: -inf = must drop, even below B ---------------------------------------------


class _DropOdd(EvictionMethod):
    """Asks to drop every odd position (-inf); the rest score by position."""

    needs = Needs(keeps_fewer=True)

    def score(self, cache):
        positions = cache.token_positions.double()
        return torch.where(positions.remainder(2) == 1, float("-inf"), positions)


class _DropOddInOneHead(EvictionMethod):
    needs = Needs(keeps_fewer=True)

    def score(self, cache):
        scores = cache.positions[0].double()[None].repeat(len(cache.keys), 1, 1)
        scores[0, 0, :20] = float("-inf")  # one KV head of one layer asks for fewer slots than the others
        return scores


def test_minus_inf_drops_below_the_budget_and_protected_slots_stay(engines, prompt_ids):
    engine = engines["qwen2"]
    prompt = prompt_ids[:50]
    with engine.session(_DropOdd(), 40, Protocol(sink=3)) as session:
        session.feed(prompt)
        kept = session.kept_positions()[0]
    # sinks 0..2 stay (1 is odd), every other odd position goes, the even ones fit in B
    assert kept == [0, 1, 2] + list(range(4, 50, 2))
    assert session.evicted_tokens == 50 - len(kept)
    with engine.session(_DropOdd(), 10, Protocol()) as session:  # more even positions than B: B of them
        session.feed(prompt)
        assert session.kept_positions()[0] == list(range(30, 50, 2))
    with pytest.raises(KvleagueError, match="different number of slots"):
        with engine.session(_DropOddInOneHead(), 40, Protocol()) as session:
            session.feed(prompt)


def test_methods_without_minus_inf_keep_exactly_b(engines, prompt_ids):
    result = engines["llama"].generate(
        prompt_ids[:50], build_method("knorm"), 40, Protocol(), GenerationSettings(max_new_tokens=10)
    )
    rows = [row for layer in result.kept_positions for row in (layer if isinstance(layer[0], list) else [layer])]
    assert result.evictions > 0 and all(len(row) == 40 for row in rows)
