"""One verdict per comparison (analysis/verdicts.py): the leaderboard with a task under two option sets (the
crash of issue 46), verdicts that do not move when an unrelated method joins, Holm within a declared family
only, and equivalence said only where the margin is tested."""

from __future__ import annotations

import pytest
from scipy.stats import binomtest

from kvleague.analysis import queries as q
from kvleague.analysis import tables, verdicts
from kvleague.db import store
from kvleague.db.models import TaskSpec
from kvleague.db.seed import Seeder, _hash
from kvleague.db.session import get_engine

DEPTHS = ("0.000", "0.200", "0.400", "0.600", "0.800", "1.000")


def _niah(s: Seeder, per_depth: int) -> int:
    spec = {
        "name": "niah",
        "domain": "longqa",
        "options": {"context_length": 512, "num_depths": 6, "samples_per_depth": per_depth},
        "dataset": "niah",
        "source": "paul_graham_essays",
        "revision": None,
        "scorer_version": "1",
        "metric": "accuracy",
    }
    return store.get_or_create(s.engine, TaskSpec, {"spec_hash": _hash(spec), **spec})


def _demo(path, right: dict[str, set[int]], second: dict[str, set[int]] | None = None) -> str:
    """The demo's shape (niah at 512 tokens, 6 depths x 3 draws, budget 320): ``right[method]`` the draws
    (0..17) it got right; ``second``: a 6-cell sweep of the same task with ``samples_per_depth: 1``."""
    url = f"sqlite:///{path}"
    s = Seeder(get_engine(url))
    model, proto, gen, sweep = s.model("smollm2-135m"), s.protocol(), s.generation(), s.sweep("demo")
    rows = []
    for per_depth, table in ((3, right), (1, second or {})):
        task = _niah(s, per_depth) if table else None
        for name, ok in table.items():
            m = s.method(name)
            for j, d in enumerate(DEPTHS):
                for i in range(per_depth):
                    draw = j * per_depth + i
                    rows.append(
                        {
                            "sweep_id": sweep,
                            "model_id": model,
                            "method_spec_id": m,
                            "task_id": task,
                            "protocol_id": proto,
                            "generation_id": gen,
                            "budget": 320,
                            "sample_id": f"L512tok-d{d}-{i}",
                            "sample_index": 0,
                            "seed": 0,
                            "correct": draw in ok,
                            "score": float(draw in ok),
                        }
                    )
    s.write(rows)
    s.engine.dispose()
    return url


DEMO = {
    "full": set(range(18)),
    "streaming_llm": set(range(9)),
    "epikv": set(range(9)),
    "h2o": set(range(16)),
}


def test_a_task_with_two_option_sets_renders_and_pairs_by_content(tmp_path):
    """The demo plus a sweep of the same task with samples_per_depth 1 (KeyError in common_set before). By
    content (analysis/identity.py) only its depth-0 needle is one of the demo's (draw 0 at depth 0; the others
    are other draws at other depths), so the domain's common set is that one prompt, while knorm against full
    pairs on the 6 prompts both have."""
    url = _demo(tmp_path / "d.db", DEMO, {"full": set(range(6)), "knorm": {0, 1, 2}})
    engine = get_engine(url)
    lb = tables.leaderboard(engine, q.Filters(), 320)
    engine.dispose()
    domain = lb.by_domain.set_index("method")
    assert domain.loc["knorm", "problems"] == 1 and domain.loc["full", "problems"] == 1
    # knorm right on depths 0-2, full on all six: 3 of 6 discordant
    assert domain.loc["knorm", "delta_full"] == pytest.approx(-50.0)
    assert domain.loc["knorm", "p_value"] == pytest.approx(binomtest(0, 3, 0.5).pvalue)
    assert domain.loc["knorm", "verdict_full"] == verdicts.TOO_FEW
    assert domain.loc["epikv", "delta_full"] == pytest.approx(-50.0)  # on its 18, full's copy of d0.000-0 once


def test_adding_a_method_changes_no_verdict_that_does_not_involve_it(tmp_path):
    """Rule: a leaderboard comparison is one method against full cache (or the table's best) on the questions the
    two have, alone in its family; so a new method (here one that ran only 6 of the 18 needles, which shrinks the
    table's common set) leaves every other comparison's Δ, p and verdict as they were."""
    before = _demo(tmp_path / "a.db", DEMO)
    after = _demo(tmp_path / "b.db", {**DEMO, "value_norm": set(range(14))}, {"knorm": {0, 1, 2}})
    tables_ = []
    for url in (before, after):
        engine = get_engine(url)
        lb = tables.leaderboard(engine, q.Filters(), 320)
        engine.dispose()
        tables_.append(lb.by_domain.set_index("method"))
    old, new = tables_
    cols = ["delta_full", "delta_lo", "delta_hi", "p_value", "verdict_full", "vs_best"]
    for m in DEMO:
        assert old.loc[m, cols].fillna("-").tolist() == new.loc[m, cols].fillna("-").tolist(), m
    # epikv and streaming_llm: 9 of 18 vs full's 18, p exact 0.0039: lower, never "tied with best"
    assert old.loc["epikv", "p_value"] == pytest.approx(binomtest(0, 9, 0.5).pvalue)
    assert old.loc["epikv", "verdict_full"] == "lower" and old.loc["epikv", "vs_best"] == "below the best"


def _tested(diff: float, p: float, n: int = 40, half: float = 0.1) -> verdicts.Tested:
    """A normal-theory comparison: estimate ± z(level) * se, with half = the 95% half-width."""
    from statistics import NormalDist

    se = half / NormalDist().inv_cdf(0.975)
    z = lambda level: NormalDist().inv_cdf(0.5 + level / 2)  # noqa: E731
    return verdicts.Tested(diff, p, "z", n, lambda level: (diff - z(level) * se, diff + z(level) * se))


def test_the_declared_rule_bonferroni_over_the_pairs_domains_with_the_interval_that_goes_with_it():
    """paper.yaml: 4 domains, so p adj = min(1, 4 p) and the interval is at 1 - 0.05 / 4; it excludes 0 exactly when
    p adj < 0.05 (checked on a normal-theory comparison whose p and interval are the same z test)."""
    from statistics import NormalDist

    assert verdicts.FAMILY_SIZE == 4 and verdicts.LEVEL == pytest.approx(0.9875)
    for diff in (0.02, 0.05, 0.065, 0.08, -0.07, 0.3):
        t = _tested(diff, 2 * (1 - NormalDist().cdf(abs(diff) / 0.025)), half=0.025 * NormalDist().inv_cdf(0.975))
        p = t.p
        v = verdicts.judge(t, "accuracy")
        assert v.p_adjusted == pytest.approx(min(1.0, 4 * p))
        assert (v.p_adjusted < 0.05) == (v.lo > 0 or v.hi < 0), diff
        assert v.word == ("higher" if diff > 0 else "lower") if v.p_adjusted < 0.05 else v.word != "higher"


def test_equivalence_only_with_the_margin_tested():
    close = verdicts.judge(_tested(0.0, 0.9, half=0.03), "accuracy")
    assert close.equivalent and close.word == "equivalent within ±5 pts" and close.margin == 0.05
    wide = verdicts.judge(_tested(0.0, 0.9, half=0.2), "accuracy")
    assert not wide.equivalent and wide.word == "inconclusive"  # not significant, and not shown equivalent
    assert verdicts.judge(_tested(0.0, 0.9, n=5, half=0.01), "accuracy").word == verdicts.TOO_FEW
    kl = verdicts.judge(_tested(0.01, 0.5, half=0.03), "kl")
    assert kl.word == "equivalent within ±0.05 nats/token"
    claim = verdicts.judge(_tested(0.0, 0.9, half=0.03), "accuracy", ("replicates", "does not replicate"), False)
    assert claim.word == "inconclusive"  # a claim tested at its own margin says nothing of equivalence


def test_a_credit_over_a_baseline_reports_recency_against_the_same_baseline():
    """EpiKV below h2o's KL is reported with StreamingLLM against h2o on the same table, and, as EpiKV does not
    beat StreamingLLM itself, "no better than recency"."""
    import pandas as pd

    from kvleague.analysis.report import fidelity_findings

    board = pd.DataFrame(
        [
            {
                "method": "epikv",
                "KL": 0.1,
                "KL 95% CI": "[0.08, 0.12]",
                "top-1 %": 90.0,
                "top-1 95% CI": "-",
                "samples": 30,
            }
        ]
    )

    def pair(a, b, shift, p, sign, verdict):
        lo, hi = (shift - 0.01, shift + 0.01) if p < 0.05 else (-0.02, 0.02)
        return {"A": a, "B": b, "Δ KL (A−B)": shift, "HL shift": shift, "Δ KL lo": lo, "Δ KL hi": hi}, {
            "p (adj.)": p,
            "sign": sign,
            "verdict": verdict,
            "samples": 30,
            "tied": 0,
        }

    rows = [
        pair("epikv", "h2o", -0.06, 0.001, -1, "A lower"),
        pair("streaming_llm", "h2o", -0.05, 0.002, -1, "A lower"),
        pair("epikv", "streaming_llm", -0.01, 0.4, -1, "inconclusive"),
    ]
    pairs = pd.DataFrame([{**a, **b} for a, b in rows])
    names = {"epikv": "epikv", "h2o": "h2o", "streaming_llm": "streaming_llm"}
    (finding,) = fidelity_findings(pairs, board, "math", 96, names)
    assert "lower than h2o (HL shift -0.060" in finding.text
    assert "control: StreamingLLM vs h2o HL shift -0.050 [-0.060, -0.040]" in finding.text, finding.text
    assert "no better than recency (against StreamingLLM itself: inconclusive)" in finding.text
    beats = pairs.assign(**{"p (adj.)": [0.001, 0.002, 0.001], "verdict": ["A lower"] * 3})
    (finding,) = fidelity_findings(beats, board, "math", 96, names)
    assert "control: StreamingLLM vs h2o" in finding.text and "no better than recency" not in finding.text


def test_distinct_prompts_are_counted_by_content_across_reference_rows():
    """The export's math, code and agentic prompts sit in two task rows each (the dataset's reference and the model's
    own continuation, ``fidelity_reference: self``): one prompt, counted once (the report's "259 samples" was 169)."""
    from kvleague.analysis.identity import prompt_key

    dataset = {"id": 3, "name": "humaneval", "options": {"timeout_s": 10.0}}
    own = {"id": 9, "name": "humaneval", "options": {"fidelity_reference": "self", "timeout_s": 10.0}}
    other = {"id": 4, "name": "kv_agent", "options": {"n_lockers": 8}}
    assert prompt_key(dataset, "HumanEval/1") == prompt_key(own, "HumanEval/1") != prompt_key(own, "HumanEval/2")
    assert prompt_key(other, "ep-1") != prompt_key({**other, "options": {"n_lockers": 9}}, "ep-1")  # another prompt
    needles = [
        {"id": i, "name": "niah", "options": {"num_depths": 6, "samples_per_depth": k}} for i, k in ((1, 3), (2, 5))
    ]
    assert prompt_key(needles[0], "L512tok-d0.200-2") == prompt_key(needles[1], "L512tok-d0.200-0")  # draw 5 of both


def test_coincident_lines_are_found_from_the_plotted_values():
    """tova and value_norm: the same accuracy at every budget (different samples right) hide each other; a method
    that differs at one budget does not."""
    import pandas as pd

    rows = [("tova", 320, 50.0), ("tova", 512, 80.0), ("value_norm", 320, 50.0), ("value_norm", 512, 80.0)]
    rows += [("h2o", 320, 50.0), ("h2o", 512, 83.3), ("tova", 320, 10.0)]
    curves = pd.DataFrame(rows, columns=["method", "budget", "accuracy"]).assign(domain=["longqa"] * 6 + ["math"])
    assert tables.coincident_lines(curves, "accuracy") == [("longqa", ["tova", "value_norm"])]
