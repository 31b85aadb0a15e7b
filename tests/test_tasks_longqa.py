"""Long-document scorers proved on gold answers: L-Eval, kv_retrieval, niah, LongBench metrics."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.longqa import (
    extract_choices,
    longbench_qa_f1,
    longbench_score,
    normalize_squad,
    token_f1,
)
from kvleague.tasks.niah import Niah
from kvleague.tasks.registry import available_tasks, build_task

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"

LEVAL_CHOICE = ["leval_quality", "leval_tpo", "leval_coursera"]
LEVAL_F1 = [
    "leval_scientific_qa",
    "leval_multidoc_qa",
    "leval_natural_question",
    "leval_financial_qa",
    "leval_legal_contract_qa",
]
LEVAL_SIZES = {
    "leval_quality": 202,
    "leval_tpo": 269,
    "leval_coursera": 172,
    "leval_sci_fi": 64,
    "leval_topic_retrieval": 150,
    "leval_gsm100": 100,
    "leval_scientific_qa": 184,
    "leval_multidoc_qa": 158,
    "leval_natural_question": 109,
    "leval_financial_qa": 68,
    "leval_legal_contract_qa": 154,
}


def test_leval_tasks_are_registered_with_sizes():
    tasks = available_tasks()
    for name, size in LEVAL_SIZES.items():
        assert tasks[name].domain == "longqa" and tasks[name].size == size
        assert tasks[name].protect_prompt is False
        assert len(build_task(name).load(data_dir=DATA_DIR)) == size


@pytest.mark.parametrize("name", LEVAL_CHOICE)
def test_leval_choice_gold_100_wrong_0(name):
    task = build_task(name)
    samples = task.load(data_dir=DATA_DIR)
    gold = [task.score(s, s.metadata["raw_answer"]) for s in samples]
    assert task.aggregate(gold)["accuracy"] == 1.0
    letters = [task.score(s, s.reference) for s in samples]
    assert task.aggregate(letters)["accuracy"] == 1.0
    # a different option: the next letter (and for multi-answer questions one letter dropped or added)
    wrong = []
    for s in samples:
        ref = s.reference
        if len(ref) > 1:
            other = ref[:-1]
        else:
            other = "ABCD"[("ABCD".index(ref) + 1) % 4]
        wrong.append(task.score(s, f"The answer is {other}."))
    assert task.aggregate(wrong)["accuracy"] == 0.0


def test_choice_extraction():
    assert extract_choices("(B) Their subconscious knew") == {"B"}
    assert extract_choices("The correct answer is (D).") == {"D"}
    assert extract_choices("Answer: A and C", multi=True) == {"A", "C"}
    assert extract_choices("ABD", multi=True) == {"A", "B", "D"}
    assert extract_choices("Because the text says so") == set()


def test_leval_quality_gold_is_the_option_letter():
    task = build_task("leval_quality")
    s = task.load(data_dir=DATA_DIR)[0]
    assert s.metadata["raw_answer"].startswith("(B)") and s.reference == "B"
    assert "(A)" in s.prompt and "(B)" in s.prompt


@pytest.mark.parametrize("name", LEVAL_F1)
def test_leval_f1_gold_100_wrong_0(name):
    task = build_task(name)
    samples = task.load(data_dir=DATA_DIR)
    gold = task.aggregate([task.score(s, s.reference) for s in samples])
    assert gold["f1"] == 1.0 and gold["exact_match"] == 1.0
    wrong = task.aggregate([task.score(s, "zyxwvut qqqq") for s in samples])
    assert wrong["f1"] == 0.0 and wrong["exact_match"] == 0.0


def test_token_f1_against_hand_computation():
    # pred tokens: [cat, sat, on, mat]; gold tokens: [cat, sat, on, red, mat, today]
    # overlap 4 -> precision 4/4, recall 4/6, F1 = 2*1*(2/3)/(1+2/3) = 0.8
    assert token_f1("The cat sat on the mat.", "A cat sat on the red mat today") == pytest.approx(0.8)
    assert token_f1("Paris", "paris!") == 1.0
    assert token_f1("London", "Paris") == 0.0
    assert normalize_squad("The  Quick, brown fox!") == "quick brown fox"


def test_leval_sci_fi_and_topic_retrieval_and_gsm100():
    sci = build_task("leval_sci_fi")
    samples = sci.load(data_dir=DATA_DIR)
    assert sci.aggregate([sci.score(s, s.metadata["raw_answer"]) for s in samples])["accuracy"] == 1.0
    flipped = {"True": "False", "False": "True"}
    assert sci.aggregate([sci.score(s, flipped[s.reference]) for s in samples])["accuracy"] == 0.0

    topic = build_task("leval_topic_retrieval")
    samples = topic.load(data_dir=DATA_DIR)
    assert topic.aggregate([topic.score(s, f"The topic was: {s.reference}") for s in samples])["accuracy"] == 1.0
    assert topic.aggregate([topic.score(s, "bananas and more bananas") for s in samples])["accuracy"] == 0.0

    gsm = build_task("leval_gsm100")
    samples = gsm.load(data_dir=DATA_DIR)
    assert gsm.aggregate([gsm.score(s, f"... The answer is {s.reference}") for s in samples])["accuracy"] == 1.0
    assert (
        gsm.aggregate([gsm.score(s, f"The answer is {int(float(s.reference)) + 1}") for s in samples])["accuracy"]
        == 0.0
    )


@pytest.mark.parametrize("name,keys", [("kv_retrieval_75", 75), ("kv_retrieval_140", 140)])
def test_kv_retrieval_gold_100_wrong_0(name, keys):
    task = build_task(name)
    samples = task.load(data_dir=DATA_DIR)
    assert len(samples) == 500
    assert all(s.metadata["num_keys"] == keys for s in samples)
    assert task.aggregate([task.score(s, f'"{s.reference}"') for s in samples])["accuracy"] == 1.0
    # the value of a different key in the same record is wrong
    wrong = []
    for s in samples:
        other = next(v for k, v in _pairs(s.prompt) if k != s.metadata["key"])
        wrong.append(task.score(s, other))
    assert task.aggregate(wrong)["accuracy"] == 0.0


def _pairs(prompt: str) -> list[tuple[str, str]]:
    import json

    blob = prompt.split("JSON data:\n", 1)[1].split("\n\nKey:", 1)[0]
    return list(json.loads(blob).items())


def test_kv_retrieval_gold_index_moves_the_pair():
    task = build_task("kv_retrieval_75", {"gold_index": 0})
    samples = task.load(limit=5, seed=0, data_dir=DATA_DIR)
    for s in samples:
        assert _pairs(s.prompt)[0] == (s.metadata["key"], s.reference)
        assert s.metadata["gold_index"] == 0
    with pytest.raises(KvleagueError, match="gold_index"):
        build_task("kv_retrieval_75", {"gold_index": 75})


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A small byte-level BPE tokenizer trained here on the essays (no Hub access needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Niah.read_corpus(DATA_DIR)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([corpus[i : i + 4000] for i in range(0, len(corpus), 4000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _haystack(prompt: str) -> str:
    return prompt.split("<text>\n", 1)[1].rsplit("\n</text>", 1)[0]


@pytest.mark.parametrize("length", [512, 3000, 20000])
def test_niah_needle_depth_and_length_are_token_accurate(bpe_tokenizer, length):
    depths = [0.0, 0.1, 0.25, 0.5, 0.77, 0.9, 1.0]
    for depth in depths:
        task = build_task("niah", {"context_length": length, "depth": depth, "samples_per_depth": 1, "seed": 7})
        task.bind_tokenizer(bpe_tokenizer)
        (s,) = task.load(data_dir=DATA_DIR)
        text = _haystack(s.prompt)
        needle = s.metadata["needle"]
        i = text.index(needle)
        count = lambda t: len(bpe_tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        before, after = count(text[:i]), count(text[i + len(needle) :])
        assert abs(before / (before + after) - depth) <= 0.01, (length, depth, before, after)
        assert abs(count(text) - length) <= 0.01 * length
        assert text.count(needle) == 1 and s.reference in needle


def test_niah_character_mode_and_sweep():
    task = build_task("niah", {"context_length": 6000, "num_depths": 5, "samples_per_depth": 2})
    samples = task.load(data_dir=DATA_DIR)
    assert [s.metadata["depth"] for s in samples] == [0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0, 1.0]
    for s in samples:
        text = _haystack(s.prompt)
        i = text.index(s.metadata["needle"])
        before, after = len(text[:i]), len(text[i + len(s.metadata["needle"]) :])
        assert abs(before / (before + after) - s.metadata["depth"]) <= 0.01
        assert abs(len(text) - 6000) <= 60


def test_niah_is_deterministic_for_a_seed():
    def gen(seed):
        return [
            (s.sample_id, s.prompt, s.reference)
            for s in build_task("niah", {"context_length": 2000, "num_depths": 3, "seed": seed}).load(data_dir=DATA_DIR)
        ]

    assert gen(3) == gen(3)
    assert gen(3) != gen(4)
    assert len({ref for _, _, ref in gen(3)}) > 1  # different needles within one set


def test_niah_gold_100_wrong_0():
    task = build_task("niah", {"context_length": 1500, "num_depths": 4, "samples_per_depth": 3})
    samples = task.load(data_dir=DATA_DIR)
    assert task.aggregate([task.score(s, f"The number is {s.reference}.") for s in samples])["accuracy"] == 1.0
    assert task.aggregate([task.score(s, str(int(s.reference) + 1)) for s in samples])["accuracy"] == 0.0


def test_niah_rejects_bad_options():
    with pytest.raises(KvleagueError, match="depth"):
        build_task("niah", {"depth": 1.5})
    with pytest.raises(KvleagueError, match="context_length"):
        build_task("niah", {"context_length": "long"})


def test_longbench_qa_f1_on_hand_made_inputs():
    # prediction tokens [john, smith]; gold "John Smith Jr." tokens [john, smith, jr]:
    # P = 1, R = 2/3, F1 = 0.8; the other gold "Smith" gives P = 1/2, R = 1, F1 = 2/3; max = 0.8
    assert longbench_qa_f1("John Smith", ["John Smith Jr.", "Smith"]) == pytest.approx(0.8)
    assert longbench_qa_f1("The answer is Paris.", ["Paris"]) == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert longbench_qa_f1("unanswerable", ["Unanswerable"]) == 1.0
    assert longbench_qa_f1("Berlin", ["Paris", "France"]) == 0.0
    assert longbench_qa_f1("", [""]) == 0.0  # LongBench scores an empty overlap as 0
    assert longbench_score(["Paris", "Berlin"], [["Paris"], ["Rome"]]) == 50.0


@pytest.mark.parametrize("subset", ["narrativeqa", "qasper", "hotpotqa", "2wikimqa", "multifieldqa_en"])
def test_longbench_tasks_score_gold_and_report_missing_data(subset, tmp_path):
    from kvleague.tasks.base import Sample

    task = build_task(f"longbench_{subset}")
    assert task.source.hub_id == "THUDM/LongBench" and task.metric == "f1"
    s = Sample(sample_id="x", task=task.name, prompt="...", reference=["the Eiffel Tower", "Eiffel Tower"])
    assert task.score(s, "Eiffel tower").score == 1.0
    assert task.score(s, "Big Ben").score == 0.0
    with pytest.raises(KvleagueError) as err:
        task.load(data_dir=tmp_path)  # no local copy here, and the Hub is offline in tests
    msg = str(err.value)
    assert "\n" not in msg and "THUDM/LongBench" in msg and f"longbench/{subset}.jsonl" in msg


def test_leval_subset_sampling_is_seeded():
    task = build_task("leval_quality")
    a = [s.sample_id for s in task.load(limit=10, seed=1, data_dir=DATA_DIR)]
    b = [s.sample_id for s in task.load(limit=10, seed=1, data_dir=DATA_DIR)]
    c = [s.sample_id for s in task.load(limit=10, seed=2, data_dir=DATA_DIR)]
    assert a == b == sorted(a) and a != c
    everything = [s.sample_id for s in task.load(data_dir=DATA_DIR)]
    assert a == sorted(everything[i] for i in random.Random(1).sample(range(len(everything)), 10))


def test_niah_lists_the_unit_of_its_context_length():
    """`kvleague tasks --json` says what context_length counts (it is tokens in a sweep)."""
    from kvleague.tasks.registry import task_class

    opts = {o["name"]: o for o in task_class("niah").describe()["options"]}
    assert opts["context_length"]["unit"].startswith("tokens of the model's tokenizer")
    assert "unit" not in opts["depth"]
