"""Teacher-forced fidelity: full cache is exact, the per-token KL equals a naive re-computation on
exactly the kept positions, and the segments walk the same tokens as the full-cache pass."""

import re

import pytest
import torch

from kvleague.engine import Session
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.methods.registry import build_method
from kvleague.runner import fidelity
from tests.naive_attention import decode_step

ARCHS = ("llama", "qwen2", "qwen3")


def _segments(engine, prompt_ids, n_scored=30):
    tail = engine.tokenizer(" and the answer, word for word, is this one", add_special_tokens=False)["input_ids"]
    return [(list(prompt_ids), False), ((tail * 4)[:n_scored], True)]


@pytest.mark.parametrize("arch", ARCHS)
def test_full_cache_is_exact(engines, prompt_ids, arch):
    engine = engines[arch]
    segs = _segments(engine, prompt_ids) + [(list(prompt_ids[:9]), False), (list(prompt_ids[:12]), True)]
    r = fidelity.measure(engine, segs, build_method("full"), 16, Protocol(prefill_chunk=7), per_token=True)
    assert r.tokens == 42 and r.top1_agreement == 1.0
    assert max(abs(k) for k in r.per_token["kl"]) <= 1e-6 and abs(r.delta_nll_mean) <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["streaming_llm", "knorm"])  # one token-level, one per-KV-head method
def test_kl_equals_a_naive_recomputation_on_the_kept_positions(engines, prompt_ids, arch, method, monkeypatch):
    engine = engines[arch]
    segs = _segments(engine, prompt_ids, 20)
    seq = [t for ids, _ in segs for t in ids]
    seen: list[list[torch.Tensor]] = []  # cache positions right after each forward (before its eviction)
    real_after_forward = Session.after_forward

    def recording_after_forward(self, positions, prompt, **kwargs):
        real_after_forward(self, positions, prompt, **kwargs)
        seen.append([p.clone() for p in self.cache.positions])

    monkeypatch.setattr(Session, "after_forward", recording_after_forward)
    result = fidelity.measure(engine, segs, build_method(method), 40, Protocol(sink=2, recent=4), per_token=True)
    monkeypatch.undo()
    assert result.generation.evictions > 10  # eviction really happened at the teacher-forced steps

    with torch.no_grad():
        out = engine.model(input_ids=torch.tensor([seq]), use_cache=True)
        full_logp = torch.log_softmax(out.logits[0].double(), -1)
        start = len(segs[0][0])
        # the oracle's own K/V per position: the prompt's from one full prefill (the engine prefills it in
        # one chunk too); every later token's from the naive step, under the reduced cache it attended to
        store = {
            t: (
                [l.keys[0][:, t] for l in out.past_key_values.layers],
                [l.values[0][:, t] for l in out.past_key_values.layers],
            )
            for t in range(start)
        }
        n = len(result.per_token["kl"])
        for i, kl in enumerate(result.per_token["kl"]):
            if i == 0:  # the prompt's own forward: nothing was evicted yet, so q is the full cache's
                assert kl <= 1e-6
                continue
            cur = start + i - 1
            kept = seen[-n + i]  # the engine's cache right after feeding `cur` (its eviction decisions)
            layer_k, layer_v = [], []
            for layer, pos in enumerate(kept):
                pos = pos.expand(len(store[0][0][layer]), -1) if pos.dim() == 1 else pos
                others = [sorted(t for t in pos[h].tolist() if t != cur) for h in range(pos.shape[0])]
                layer_k.append(
                    torch.stack([torch.stack([store[t][0][layer][h] for t in idx]) for h, idx in enumerate(others)])
                )
                layer_v.append(
                    torch.stack([torch.stack([store[t][1][layer][h] for t in idx]) for h, idx in enumerate(others)])
                )
            logits, new_k, new_v = decode_step(engine.model, layer_k, layer_v, seq[cur], cur)
            store[cur] = (new_k, new_v)
            q = torch.log_softmax(logits.double(), -1)
            p = full_logp[cur]
            assert kl == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-3, abs=1e-6)
    assert result.kl_mean > 1e-4  # eviction changed the distribution: the check above is not vacuous


def test_truncate_and_bad_segments():
    segs = [([1, 2], False), ([3, 4, 5], True), ([6], False), ([7, 8], True)]
    assert fidelity.truncate(segs, 4) == [([1, 2], False), ([3, 4, 5], True), ([6], False), ([7], True)]
    assert fidelity.truncate(segs, 3) == [([1, 2], False), ([3, 4, 5], True), ([6], False)]
    with pytest.raises(KvleagueError, match="start with an unscored prompt"):
        fidelity.check_segments([([1], True)])
    with pytest.raises(KvleagueError, match="at least one scored token"):
        fidelity.check_segments([([1], False)])


# ---- the tasks' reference continuations --------------------------------------------------------

DATA_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@pytest.mark.parametrize(
    "name,options,limit",
    [
        ("math500", {}, 40),
        ("gsm8k", {}, 40),
        ("aime24", {}, 30),
        ("humaneval", {}, 20),
        ("mbpp", {}, 20),
        ("niah", {"context_length": 300, "num_depths": 3, "samples_per_depth": 2}, 6),
        ("kv_retrieval_75", {}, 10),
        ("leval_tpo", {}, 20),
        ("leval_scientific_qa", {}, 20),
        ("kv_agent", {}, 10),
        ("bfcl_multi_turn", {}, 6),
    ],
)
def test_a_reference_continuation_is_a_correct_answer(name, options, limit, engines):
    """The oracle is the task's own scorer: what fidelity teacher-forces must be a right answer."""
    from kvleague.tasks.registry import build_task

    if not DATA_DIR.is_dir():
        pytest.skip("no local data")
    task = build_task(name, options)
    assert task.has_reference()
    tok = engines["llama"].tokenizer
    samples = task.load(limit=limit, seed=0, data_dir=DATA_DIR)
    right = 0
    for s in samples:
        segments = task.fidelity_segments(s, tok)
        assert segments[0] == (task.build_prompt(s, tok), False) and any(scored for _, scored in segments)
        if getattr(task, "episodic", False):  # the reference agent's turns, replayed, must solve the episode
            from kvleague.tasks.episode import ScriptedSession

            turns = iter([tok.decode(ids, skip_special_tokens=True) for ids, scored in segments if scored])
            result = task.run_episode(
                s,
                ScriptedSession(tok, lambda ctx, turns=turns: next(turns)),
                tok,
                GenerationSettings(max_new_tokens=8),
            )
            right += result.score.correct
        else:
            right += task.score(s, task.reference_continuation(s)).correct
    # a few MATH / HumanEval references are not accepted by the checker as written; nearly all are
    assert right >= 0.9 * len(samples), (right, len(samples))


def test_fidelity_of_a_task_without_references_is_one_line_exit_2(capsys):
    from kvleague.cli import main

    assert main(["fidelity", "--task", "aime25", "--method", "full", "--budget", "64"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "kvleague: error: task: aime25 has no reference continuation for fidelity"


def test_fidelity_cli_shares_one_reference_and_reports_per_sample(tiny_models, capsys):
    from kvleague.cli import main

    if not (DATA_DIR / "gsm8k").is_dir():
        pytest.skip("no local GSM8K")
    argv = [
        "fidelity",
        "--model",
        str(tiny_models["llama"]),
        "--task",
        "gsm8k",
        "--method",
        "full",
        "--method",
        "streaming_llm",
        "--budget",
        "32",
        "--budget",
        "48",
        "--limit",
        "2",
        "--max-tokens",
        "12",
        "--sink",
        "2",
        "--recent",
        "4",
        "--data-dir",
        str(DATA_DIR),
        "--json",
        "-",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    report = __import__("json").loads(out[out.index("{") :])
    # what a long run will cost, first: the plan, then the first sample's time times the samples
    lines = err.splitlines()
    assert lines[0].startswith("[gsm8k] up to 2 samples x 2 methods x 2 budgets (3 runs per sample")
    per, total = re.search(r"estimate: ([\d.]+)s per sample \(the first\) x 2 samples = about (\d+)s", err).groups()
    assert abs(float(per) * 2 - int(total)) <= 1
    rows = report["samples"]
    assert len(rows) == 2 * (1 + 2)  # full once per sample, streaming_llm at both budgets
    assert all(r["tokens"] == 12 for r in rows)
    by = {(s["method"], s["budget"]): s for s in report["summary"]}
    assert by[("full", 32)]["kl_mean"] < 1e-6 and by[("full", 32)]["top1"] == 1.0
    assert by[("streaming_llm", 32)]["kl_mean"] > by[("streaming_llm", 48)]["kl_mean"] > 0
    assert (
        by[("streaming_llm", 32)]["kl_lo"] <= by[("streaming_llm", 32)]["kl_mean"] <= by[("streaming_llm", 32)]["kl_hi"]
    )
    # a sample's methods and budgets are forced together by default; one at a time gives the same rows
    assert main(argv + ["--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    single = __import__("json").loads(out[out.index("{") :])["samples"]
    for a, b in zip(rows, single):
        assert (a["sample_id"], a["method"], a["budget"], a["evictions"]) == (
            b["sample_id"],
            b["method"],
            b["budget"],
            b["evictions"],
        )
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-3, abs=1e-6)
    assert main(argv + ["--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip().startswith("kvleague: error: --batch-size: must be a positive integer")


# ---- one definition of the protocol flags --------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--method", "full", "--budget", "64", "--prompt", "x"],
        ["fidelity", "--task", "gsm8k", "--method", "full", "--budget", "64"],
    ],
)
def test_generate_and_fidelity_read_the_protocol_flags_alike(command):
    from kvleague.cli import build_parser, protocol_from_args

    parse = lambda *extra: protocol_from_args(build_parser().parse_args([*command, *extra]))  # noqa: E731
    assert parse() == Protocol()  # the same defaults in both commands: Protocol's own
    assert parse("--protocol", "epikv_paper") == Protocol.preset("epikv_paper")
    assert parse(
        "--sink",
        "4",
        "--recent",
        "16",
        "--cadence",
        "buffer=8",
        "--positions",
        "compact",
        "--protect-prompt",
        "--prefill-chunk",
        "32",
    ) == Protocol(sink=4, recent=16, cadence="buffer=8", positions="compact", protect_prompt=True, prefill_chunk=32)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--protocol", "nope"], "kvleague: error: --protocol: unknown preset 'nope'; allowed: epikv_paper, kvpress"),
        (
            ["--protocol", "epikv_paper", "--sink", "4", "--protect-prompt"],
            "kvleague: error: --protocol: the preset epikv_paper sets every protocol field; drop --sink, --protect-prompt",
        ),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--method", "full", "--budget", "64", "--prompt", "x"],
        ["fidelity", "--task", "gsm8k", "--method", "full", "--budget", "64"],
    ],
)
def test_bad_protocol_flags_are_one_line_exit_2(command, extra, message, capsys):
    from kvleague.cli import main

    assert main([*command, "--model", "/no/such/dir", *extra]) == 2  # refused before the model is looked at
    assert capsys.readouterr().err.strip() == message


def test_fidelity_cli_takes_the_epikv_paper_preset(tiny_models, capsys):
    from kvleague.cli import main

    if not (DATA_DIR / "gsm8k").is_dir():
        pytest.skip("no local GSM8K")
    argv = [
        "fidelity",
        "--model",
        str(tiny_models["llama"]),
        "--task",
        "gsm8k",
        "--method",
        "full",
        "--method",
        "knorm",
        "--budget",
        "48",
        "--limit",
        "1",
        "--max-tokens",
        "8",
        "--protocol",
        "epikv_paper",
        "--data-dir",
        str(DATA_DIR),
        "--json",
        "-",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = __import__("json").loads(out[out.index("{") :])
    assert report["protocol"] == Protocol.preset("epikv_paper").model_dump(mode="json")
    full, knorm = report["samples"]
    assert full["kl_mean"] < 1e-6 and knorm["prompt_tokens"] > 48  # the prompt is kept whole (prompt_over_budget: keep)


def test_fidelity_cli_reports_progress_before_the_first_sample_is_done(tiny_models, capsys, monkeypatch):
    """Lines on stderr before the model loads and before the first sample's runs start: what a long first
    sample (minutes on long prompts) is doing, not only a line once it has finished."""
    from kvleague.cli import main

    if not (DATA_DIR / "gsm8k").is_dir():
        pytest.skip("no local GSM8K")
    seen = []
    reference = fidelity.full_cache_logprobs

    def noting_reference(engine, segments):  # the first sample's work begins
        seen.append(capsys.readouterr().err)
        return reference(engine, segments)

    monkeypatch.setattr(fidelity, "full_cache_logprobs", noting_reference)
    argv = [
        "fidelity",
        "--model",
        str(tiny_models["llama"]),
        "--task",
        "gsm8k",
        "--method",
        "full",
        "--method",
        "streaming_llm",
        "--budget",
        "32",
        "--budget",
        "48",
        "--limit",
        "2",
        "--max-tokens",
        "12",
        "--data-dir",
        str(DATA_DIR),
    ]
    assert main(argv) == 0
    before = seen[0].splitlines()
    assert before[0] == (
        "[gsm8k] up to 2 samples x 2 methods x 2 budgets (3 runs per sample, a method that never evicts once); "
        f"loading {tiny_models['llama']}; the time per sample, measured on the first, follows it"
    )
    assert before[1].startswith("[gsm8k] 2 samples, loaded in ")
    assert before[2].startswith("[gsm8k] sample 1/2: a full-cache pass and 3 runs over ") and before[2].endswith(
        " (12 scored)"
    )
    assert not any("1/2 samples" in line for line in before)  # the per-sample line comes after
    assert "[gsm8k] 1/2 samples, " in seen[1]
