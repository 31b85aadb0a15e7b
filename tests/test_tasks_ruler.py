"""RULER tasks (issue 48): the generator (deterministic by seed, needles where RULER puts them, the
length in tokens of the bound tokenizer) and RULER's string-match scorer on hand-computed examples.
The tokenizer is the tiny byte-level one (one token per byte), so every length is countable by hand."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.runner.models.tiny import byte_level_tokenizer
from kvleague.tasks.registry import available_tasks, build_task
from kvleague.tasks.ruler import clean, string_match_all, string_match_part
from tests.conftest import DATA_DIR

#: tokens (bytes), the tokens to generate included: RULER grows an essay haystack 500 words (~3 KB) at a time
LENGTHS = {"niah_single_1": 1200, "vt": 1500, "cwe": 3000, "fwe": 1500}
ESSAY = 4500

pytestmark = pytest.mark.skipif(
    not (DATA_DIR / "paul_graham_essays").is_dir(), reason="no essays in the data directory"
)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def samples(name: str, tokenizer, n: int = 3, seed: int = 42, length: int | None = None):
    length = length or LENGTHS.get(name, ESSAY)
    task = build_task(f"ruler_{name}", {"context_length": length, "num_samples": n, "seed": seed})
    task.bind_tokenizer(tokenizer)
    return task, task.load(data_dir=DATA_DIR)


def test_the_thirteen_ruler_tasks_are_registered():
    names = {n.removeprefix("ruler_") for n in available_tasks() if n.startswith("ruler_")}
    assert len(names) == 13 and {"niah_single_1", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"} <= names


@pytest.mark.parametrize("name", ["niah_single_2", "vt"])
def test_generation_is_deterministic_by_seed(tokenizer, name):
    _, a = samples(name, tokenizer, n=2)
    _, b = samples(name, tokenizer, n=2)
    _, c = samples(name, tokenizer, n=2, seed=7)
    assert [(s.prompt, s.reference) for s in a] == [(s.prompt, s.reference) for s in b]
    assert [s.reference for s in a] != [s.reference for s in c]


@pytest.mark.parametrize(
    "name, needles, asked",
    [("niah_single_1", 1, 1), ("niah_multikey_1", 4, 1), ("niah_multivalue", 4, 1), ("niah_multiquery", 4, 4)],
)
def test_needles_are_in_the_context_and_answer_the_question(tokenizer, name, needles, asked):
    task, got = samples(name, tokenizer, n=2)
    for s in got:
        context, question = s.metadata["context"], s.metadata["question"]
        found = re.findall(r"One of the special magic numbers? for (\S+) is: (\d+)\.", context)
        assert len(found) == needles
        values = {value: key for key, value in found}
        assert len(s.reference) == asked * (4 if name == "niah_multivalue" else 1)
        for value in s.reference:  # each reference is a needle's value, and its key is the one asked
            assert value in values and values[value] in question
        if name == "niah_single_1":  # the noise haystack: the needle is a line of its own
            assert "\n" + f"One of the special magic number for {found[0][0]}" not in context  # singular kind
            assert any(line.startswith("One of the special magic") for line in context.split("\n"))
            assert question.startswith("What is the special magic number for")
        else:  # the essay haystack: a needle sits between sentences
            for key, value in found:
                i = context.index(f"for {key} is: {value}.")
                before = context[: context.rfind("One of", 0, i)].rstrip()
                assert before.endswith((".", "!", "?", "text.", "afterwards.")), before[-40:]


def test_length_in_tokens_fills_the_context(tokenizer):
    """RULER's max_seq_length: prompt tokens + tokens to generate <= context_length, the haystack as large
    as fits (within one growth step: RULER grows noise 5 sentences of 92 bytes at a time below 4k)."""
    for name, slack in [("niah_single_1", 5 * 92), ("vt", 10 * 92)]:
        task, got = samples(name, tokenizer, length=3000)
        for s in got:
            text = s.metadata["context"] + s.metadata["question"] + s.metadata["answer_prefix"]
            assert text == s.prompt
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            assert n + task.max_new_tokens == s.metadata["length"] <= 3000
            assert s.metadata["length"] > 3000 - slack


def test_vt_chain_is_in_order_and_cwe_fwe_counts(tokenizer):
    _, (vt, *_) = samples("vt", tokenizer)
    lines = [line for line in vt.metadata["context"].split("\n") if line.startswith("VAR")]
    names = vt.reference
    assert lines[0].split(" = ")[0] == f"VAR {names[0]}" and lines[0].split(" = ")[1] in vt.metadata["question"]
    assert [line.strip() for line in lines[1:]] == [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(4)]

    _, (cwe, *_) = samples("cwe", tokenizer, n=1)  # below 4k: RULER's counts 6 and 1
    main = cwe.metadata["context"].rsplit("Below is a numbered list", 1)[1]
    counts = Counter(re.findall(r"\d+\. (\w+)", main))
    assert {counts[w] for w in cwe.reference} == {6} and set(counts.values()) - {6} == {1}
    assert cwe.metadata["length"] <= 3000

    _, (fwe, *_) = samples("fwe", tokenizer, n=1)
    ranked = [w for w, _ in Counter(fwe.metadata["context"].split("words. ", 1)[1].split()).most_common()]
    assert ranked[0] == "..." and set(ranked[1:4]) == set(fwe.reference)


def test_qa_without_its_data_is_refused_in_one_line(tokenizer):
    task = build_task("ruler_qa_2", {"num_samples": 1})
    with pytest.raises(KvleagueError, match=r"^task ruler_qa_2: RULER's QA needs HotpotQA \(dev\)[^\n]*$"):
        task.load(data_dir=DATA_DIR)


def test_string_match_scores_hand_computed_examples():
    refs = ["1234567", "7654321", "UUID-ab"]
    assert string_match_all("The numbers are 1234567 and uuid-AB.", refs) == pytest.approx(2 / 3)
    assert string_match_part("The numbers are 1234567 and uuid-AB.", refs) == 1.0
    assert string_match_part("none here", refs) == 0.0
    assert clean("  \x01QTOFU,\tTRTKR\n ") == "QTOFU,TRTKR"
    task = build_task("ruler_vt", {"num_samples": 1})
    from kvleague.tasks.base import Sample

    sample = Sample("s", "ruler_vt", "", ["AAAAA", "BBBBB", "CCCCC", "DDDDD"])
    result = task.score(sample, " aaaaa, BBBBB,\x00 and ccccc")
    assert result.score == pytest.approx(3 / 4) and not result.correct
    assert task.aggregate([result, task.score(sample, "AAAAA BBBBB CCCCC DDDDD")])["string_match"] == pytest.approx(
        7 / 8
    )
