"""Synthetic long-dependency tasks: registration, determinism, distances, exact scorers, held-out split."""

from __future__ import annotations

import random

import pytest

from runner.errors import KvleagueError
from runner.tiny_model import byte_level_tokenizer
from tasks import synthetic as S
from tasks.registry import available_tasks, build_task

NAMES = {"synth_math": "math", "synth_code": "code", "synth_agentic": "agentic", "synth_longqa": "longqa"}
LONG = {"length": 520, "min_distance": 320}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def test_registered_with_domains_and_knobs():
    tasks = available_tasks()
    for name, domain in NAMES.items():
        cls = tasks[name]
        assert cls.domain == domain
        assert cls.protect_prompt is False
        opts = {o["name"] for o in cls.describe()["options"]}
        assert {"length", "min_distance", "max_distance", "n_keys", "n_samples", "seed"} <= opts


def test_options_are_validated():
    with pytest.raises(KvleagueError, match="min_distance"):
        build_task("synth_math", {"length": 200, "min_distance": 300})
    with pytest.raises(KvleagueError, match="max_distance"):
        build_task("synth_code", {"min_distance": 100, "max_distance": 50})
    with pytest.raises(KvleagueError, match="n_keys"):
        build_task("synth_longqa", {"n_keys": 9})
    with pytest.raises(KvleagueError, match="n_keys"):
        build_task("synth_code", {"n_keys": 0})
    with pytest.raises(KvleagueError, match="unknown option"):
        build_task("synth_agentic", {"distance": 3})


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_seeded(name):
    a = build_task(name, {"n_samples": 30}).load()
    b = build_task(name, {"n_samples": 30}).load()
    assert [(s.prompt, s.reference) for s in a] == [(s.prompt, s.reference) for s in b]
    c = build_task(name, {"n_samples": 30, "seed": 1}).load()
    assert sum(x.prompt == y.prompt for x, y in zip(a, c)) == 0
    sub = build_task(name).load(limit=10, seed=3)
    assert len(sub) == 10 and sub == build_task(name).load(limit=10, seed=3)
    assert len({s.sample_id for s in build_task(name).load()}) == build_task(name).size


def _fact_value_at(ids: list[int], tokenizer, distance: int, value: str) -> str:
    end = len(ids) - distance
    return tokenizer.decode(ids[end - len(value) : end])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("options", [{}, LONG], ids=["default", "long"])
def test_dependency_distance_is_exact_and_bounded(name, options, tokenizer):
    """``distance`` counts byte-level prompt tokens from the end of the needed value to the end of the
    prompt: the value sits exactly there, right after its key, and nowhere later in the prompt."""
    task = build_task(name, {**options, "n_samples": 60})
    lo = options.get("min_distance", 0)
    for i, sample in enumerate(task.load()):
        ids = task.build_prompt(sample, tokenizer)
        ex = task._example(i)
        for key, dist in zip(ex.targets, S.distances(ex, ex.targets)):
            assert dist >= lo
            value = ex.facts[key].value
            assert _fact_value_at(ids, tokenizer, dist, value) == value
            before = tokenizer.decode(ids[: len(ids) - dist])
            assert before.endswith(f"{key}={value}")
            # the key is never bound again later in the prompt
            assert f"{key}=" not in tokenizer.decode(ids[len(ids) - dist :])
        assert sample.metadata["distance"] == min(S.distances(ex, ex.targets))
        assert sample.reference == " ".join(f"{k}={ex.facts[k].value}" for k in ex.targets)


def test_long_variants_are_far_and_default_prompts_fit_a_few_hundred_tokens(tokenizer):
    for name in NAMES:
        long = build_task(name, LONG).load()
        assert min(s.metadata["distance"] for s in long) >= 320
        lengths = [len(build_task(name).build_prompt(s, tokenizer)) for s in build_task(name).load(limit=20)]
        assert 300 < max(lengths) < 700


@pytest.mark.parametrize("name", NAMES)
def test_scorers_are_exact(name):
    task = build_task(name)
    sample = task.load(limit=1)[0]
    gold = sample.reference
    (key,), (value,) = sample.metadata["keys"], sample.metadata["values"]
    assert gold == f"{key}={value}"
    assert task.score(sample, gold).correct
    assert task.score(sample, f"  {key} = {value}  \nanything after the first line").correct
    assert task.score(sample, value).correct  # a bare value answers the asked key
    wrong = str((int(value) + 1) % 10000)
    for completion in (f"{key}={wrong}", f"{key}={value}0", "", wrong, f"none\n{gold}", f"zz={value}"):
        assert not task.score(sample, completion).correct, completion
    r = task.score(sample, gold)
    assert r.score == 1.0 and r.extracted == gold and r.sample_id == sample.sample_id


def test_longqa_several_keys_partial_credit():
    task = build_task("synth_longqa", {"n_keys": 3})
    sample = task.load(limit=1)[0]
    a, b, c = sample.reference.split(" ")
    assert task.score(sample, f"{c}, {a}, {b}").correct  # pairs in any order
    res = task.score(sample, f"{a} {b.split('=')[0]}=0 {c}")
    assert not res.correct and res.score == pytest.approx(2 / 3)
    assert res.extracted.count("=") == 3
    bare = " ".join(v.split("=")[1] for v in (a, b, c))
    assert task.score(sample, bare).correct


def test_agentic_is_a_chat_with_tool_turns():
    sample = build_task("synth_agentic").load(limit=1)[0]
    roles = [m["role"] for m in sample.prompt]
    assert roles[-1] == "user" and sample.prompt[-1]["content"].startswith("recall ")
    assert roles[0] == "system" and {"user", "assistant", "tool"} <= set(roles)


def test_held_out_samples_never_appear_in_training_stream():
    from runner.organism import SYNTH_TASKS, OrganismConfig, TokenCodec, training_batch
    from runner.organism_tokenizer import organism_tokenizer

    tok = organism_tokenizer()
    codec = TokenCodec(tok)
    held_out = set()
    for name in SYNTH_TASKS:
        for opts in ({}, LONG):
            task = build_task(name, opts)
            for s in task.load(limit=50):
                held_out.add(tok.decode(task.build_prompt(s, tok)[:-12]))
    config = OrganismConfig(steps=1000, batch_size=16)
    for step in range(0, 1000, 50):
        ids, answer, _ = training_batch(config, step, codec)
        for row in ids:
            text = tok.decode(row.tolist())
            assert not any(h in text for h in held_out)


def test_generators_raise_when_distance_is_impossible():
    with pytest.raises(ValueError, match="distance"):
        S.make_example("synth_math", random.Random(0), 120, 110, 111)


@pytest.mark.parametrize("name", NAMES)
def test_several_keys_per_question(name, tokenizer):
    task = build_task(name, {"n_keys": 3, "n_samples": 20})
    for sample in task.load():
        assert len(sample.metadata["keys"]) == len(set(sample.metadata["keys"])) == 3
        assert task.score(sample, sample.reference).correct
        assert sample.reference.split(" ")[0].startswith(sample.metadata["keys"][0] + "=")
