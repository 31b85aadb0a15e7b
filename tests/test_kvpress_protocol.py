"""kvpress's protocol in kvleague and the kvpress bridge's edges (issue 48): ratio budgets from the YAML
to the engine (kvpress's own ``compute_n_kept`` as the oracle), the context compressed once and nothing
after it, one-line errors for bad press names, params and phases, the sweeps' configs, the dashboard's
ratio axis. The pipeline equivalence itself is tests/test_kvpress_pipeline.py."""

from __future__ import annotations

import random

import pytest

from kvleague.analysis.queries import budget_label
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods import build_method
from kvleague.runner.sweep_config import SweepConfig
from tests.conftest import REPO

kvpress = pytest.importorskip("kvpress")

BASE = {
    "name": "t",
    "models": [{"source": "smollm2-135m"}],
    "methods": ["knorm"],
    "tasks": [{"name": "ruler_vt"}],
}


def test_ratio_budgets_parse_and_resolve_as_kvpress_keeps():
    config = SweepConfig(**BASE, budgets=["ratio 0.25", "ratio 0.5"], protocol="kvpress")
    assert config.budgets == [250, 500] and config.protocol.budget_base == "ratio"
    protocol = Protocol.preset("kvpress")
    rng = random.Random(0)
    for _ in range(2000):  # kvpress's own rounding is the oracle
        ratio, n = round(rng.uniform(0.001, 0.999), 3), rng.randint(1, 20000)
        resolved, budget = protocol.for_prompt(round(ratio * 1000), n)
        assert budget == kvpress.utils.compute_n_kept(n, ratio) and resolved.budget_base == "none"
    assert budget_label(250, "ratio") == "ratio 0.25" and budget_label(64, "prompt") == "prompt+64"


@pytest.mark.parametrize(
    "budgets, protocol, message",
    [
        (["ratio 0.5", 64], None, "budgets: got 64; allowed: all integers, all prompt+N"),
        (["ratio 1.5"], None, "budgets: got 'ratio 1.5'; allowed:"),
        (["ratio 0.5"], {"budget_base": "prompt"}, "budgets: ratio R needs protocol.budget_base ratio, got 'prompt'"),
    ],
)
def test_bad_ratio_budgets_are_one_line(budgets, protocol, message):
    with pytest.raises(Exception) as info:
        SweepConfig(**BASE, budgets=budgets, **({"protocol": protocol} if protocol else {}))
    text = str(info.value)
    assert message in text and "\n" not in text.strip().splitlines()[-1]


def test_context_is_compressed_once_and_what_follows_stays(engines):
    engine = engines["llama"]
    ids = engine.tokenizer("The cache keeps what the press scores highest, no more. " * 3)["input_ids"]
    question = engine.tokenizer(" What stays?\n")["input_ids"]
    protocol, budget = Protocol.preset("kvpress").for_prompt(500, len(ids))
    result = engine.generate((ids, question), build_method("knorm"), budget, protocol, GenerationSettings(12))
    assert result.evictions == 1 and result.evicted_tokens == len(ids) - budget
    n = len(ids) + len(question) + len(result.token_ids) - 1  # the last token is never fed
    for layer in result.kept_positions:
        for head in layer if isinstance(layer[0], list) else [layer]:
            assert sum(p < len(ids) for p in head) == budget
            assert [p for p in head if p >= len(ids)] == list(range(len(ids), n))


def test_bridge_errors_are_one_line(engines):
    cases = [
        (
            "kvpress:NoSuchPress",
            {},
            "method: unknown kvpress press 'NoSuchPress'; bridged: CURPress, CapPress, CompactorPress",
        ),
        ("kvpress:DuoAttentionPress", {}, "method kvpress:DuoAttentionPress: not a plain ScorerPress"),
        ("kvpress:CriticalKVPress", {}, "method kvpress:CriticalKVPress: field press is a"),
        (
            "kvpress:SnapKVPress",
            {"window_size": "wide"},
            "method kvpress:SnapKVPress: hyperparameter window_size='wide'",
        ),
        (
            "kvpress:SnapKVPress",
            {"window": 3},
            "method kvpress:SnapKVPress: unknown hyperparameter 'window'; valid: window_size",
        ),
    ]
    for name, params, message in cases:
        with pytest.raises(KvleagueError) as info:
            build_method(name, params)
        assert str(info.value).startswith(message) and "\n" not in str(info.value)
    engine = engines["llama"]
    ids = list(range(40, 120))
    # a press that scores from the context's hidden states has no decode-time score
    with pytest.raises(
        KvleagueError, match=r"^method kvpress:SnapKVPress: scores the context .* allowed: protocol kvpress"
    ):
        engine.generate(ids, build_method("kvpress:SnapKVPress"), 70, Protocol(), GenerationSettings(4))
    # one that scores from keys evicts at every decode step, as any method
    result = engine.generate(ids, build_method("kvpress:KnormPress"), 70, Protocol(), GenerationSettings(4))
    assert result.evictions == 1 + 3 and all(len(h) == 70 for layer in result.kept_positions for h in layer)


def test_the_kvpress_sweeps_check_and_methods_lists_the_presses(capsys):
    from kvleague.cli import main
    from kvleague.runner.sweeping.checks import load_checked_config

    gpu = load_checked_config(REPO / "sweeps" / "kvpress_ruler.yaml")
    assert gpu.budgets == list(range(100, 1000, 100)) and gpu.protocol.scope == "context"
    assert {m.name for m in gpu.methods} >= {"kvpress:ExpectedAttentionPress", "kvpress:SnapKVPress", "full"}
    cpu = load_checked_config(REPO / "sweeps" / "kvpress_ruler_cpu.yaml")
    assert cpu.models[0].source == "smollm2-135m" and cpu.protocol.budget_base == "ratio"
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "kvpress:ExpectedAttentionPress kvpress ExpectedAttentionPress (prefill only)" in out
    assert "kvpress:AdaKVPress refused: not a plain ScorerPress" in out
