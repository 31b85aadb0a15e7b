"""A budget the run can never reach is said, once, and in its results (issue 50): it runs as the full
cache (the oracle: method ``full``'s completion, and no eviction), where a binding budget evicts."""

from __future__ import annotations

import json

from kvleague.cli import main


def generate(capsys, model, method: str, budget: int) -> tuple[dict, str]:
    argv = ["generate", "--model", str(model), "--method", method, "--budget", str(budget)]
    assert main([*argv, "--prompt", "Hello there", "--max-new-tokens", "8", "--chat", "off", "--json"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_generate_warns_once_for_a_budget_past_the_prompt_and_new_tokens(tiny_models, capsys):
    model = tiny_models["llama"]
    full, _ = generate(capsys, model, "full", 10_000)
    unbound, err = generate(capsys, model, "h2o", 10_000)
    assert err.count("warning:") == 1 and "budget 10,000 holds the whole prompt" in err
    assert unbound["budget_never_binds"] and unbound["evictions"] == 0
    assert unbound["token_ids"] == full["token_ids"]
    bound, err = generate(capsys, model, "h2o", unbound["prompt_tokens"] + 2)
    assert "warning" not in err and bound["budget_never_binds"] is None and bound["evictions"] > 0


def test_a_budget_past_the_context_binds_only_under_compact_positions():
    """Under true positions no run passes the model's context; compact positions let one go past it."""
    from kvleague.runner.budget_reach import never_binds

    assert "context of 2,048" in never_binds(4096, None, 100, 2048, "absolute")
    assert never_binds(4096, None, 100, 2048, "compact") is None
    assert never_binds(4096, 5000, 100, 2048, "compact") is None
    assert never_binds(100, 60, 40, None, "absolute") and never_binds(100, 61, 40, None, "absolute") is None
