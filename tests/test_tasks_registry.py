"""The task contract: registry, options, data resolution, deterministic loading, prompt building."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

import kvleague.engine.registry as generic
import kvleague.tasks.registry as registry
from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import DOMAINS, DataSource, Sample, ScoreResult, Task
from kvleague.tasks.data import DATA_DIR_ENV, resolve_data_dir
from kvleague.tasks.registry import available_tasks, build_task, register_task, register_task_family, task_class

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"

MINE = {
    "math500": ("math", 500),
    "aime24": ("math", 30),
    "aime25": ("math", 30),
    "gsm8k": ("math", 1319),
    "humaneval": ("code", 164),
    "mbpp": ("code", 257),
    "mbpp_full": ("code", 500),
    "leval_quality": ("longqa", 202),
    "kv_retrieval_75": ("longqa", 500),
    "kv_retrieval_140": ("longqa", 500),
    "niah": ("longqa", 55),
    "longbench_narrativeqa": ("longqa", 200),
    "longbench_qasper": ("longqa", 200),
    "longbench_hotpotqa": ("longqa", 200),
    "longbench_2wikimqa": ("longqa", 200),
    "longbench_multifieldqa_en": ("longqa", 150),
}


@pytest.fixture
def isolated_registry(monkeypatch):
    available_tasks()  # load the built-ins first
    monkeypatch.setattr(registry.TASKS, "classes", dict(registry.TASKS.classes))
    monkeypatch.setattr(registry.TASKS, "families", dict(registry.TASKS.families))
    return registry


def test_builtin_tasks_are_registered():
    tasks = available_tasks()
    assert list(tasks) == sorted(tasks)
    for name, (domain, size) in MINE.items():
        cls = tasks[name]
        assert cls.name == name and cls.domain == domain and cls.size == size
        assert isinstance(cls.source, DataSource) and cls.source.dataset
        assert cls.source.hub_id or cls.source.url  # users without the local copy know where to go
    for cls in tasks.values():
        assert cls.domain in DOMAINS
        json.dumps(cls.describe(), default=str)


def test_unknown_task_lists_valid_names():
    with pytest.raises(KvleagueError) as err:
        task_class("math5000")
    msg = str(err.value)
    assert "\n" not in msg and "'math5000'" in msg and "math500" in msg and "humaneval" in msg


def test_build_task_validates_options():
    task = build_task("niah", {"context_length": "2048", "depth": 0.5})
    assert task.context_length == 2048 and task.depth == 0.5  # validated and coerced
    with pytest.raises(KvleagueError, match=r"unknown option 'lenght'; valid: context_length, depth"):
        build_task("niah", {"lenght": 5})
    with pytest.raises(KvleagueError, match="option context_length="):
        build_task("niah", {"context_length": "very long"})
    with pytest.raises(KvleagueError, match="unknown option 'x'; valid: none"):
        build_task("math500", {"x": 1})
    with pytest.raises(KvleagueError, match="timeout_s"):
        build_task("humaneval", {"timeout_s": 0})


def test_register_checks_classes(isolated_registry):
    class NotATask:
        pass

    with pytest.raises(KvleagueError, match="not a Task subclass"):
        register_task("bogus")(NotATask)

    class NoDataclass(Task):
        domain: ClassVar[str] = "math"

    with pytest.raises(KvleagueError, match="must be decorated with @dataclass"):
        register_task("bogus")(NoDataclass)

    @dataclass
    class BadDomain(Task):
        domain: ClassVar[str] = "poetry"

    with pytest.raises(KvleagueError, match="domain 'poetry' is not one of math, code, agentic, longqa"):
        register_task("bogus")(BadDomain)

    @dataclass
    class Twice(Task):
        domain: ClassVar[str] = "math"

    with pytest.raises(KvleagueError, match="registered twice"):
        register_task("math500")(Twice)


def _toy_task_class():
    @dataclass
    class Toy(Task):
        """A toy task from a plugin."""

        domain: ClassVar[str] = "math"
        source: ClassVar[DataSource] = DataSource(
            dataset="toy", hub_id=None, revision=None, local_path=None, license="MIT", url="https://example.invalid"
        )
        size: ClassVar[int] = 3
        n: int = 3

        def load_records(self, data_dir):
            return [
                Sample(sample_id=f"t{i}", task=self.name, prompt=f"{i}+{i}=", reference=2 * i) for i in range(self.n)
            ]

        def score(self, sample, completion):
            ok = completion.strip() == str(sample.reference)
            return ScoreResult(correct=ok, score=float(ok), extracted=completion.strip(), sample_id=sample.sample_id)

    return Toy


def test_entry_point_plugins_are_discovered(isolated_registry, monkeypatch):
    toy = _toy_task_class()

    class FakeEntryPoint:
        name = "toy_plugin"
        value = "toy_pkg:Toy"

        def load(self):
            return toy

    seen = []

    def fake_entry_points(group):
        seen.append(group)
        return [FakeEntryPoint()]

    monkeypatch.setattr(generic, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry.TASKS, "loaded", False)
    tasks = available_tasks()
    assert seen == ["kvleague.tasks"]
    assert tasks["toy_plugin"] is toy and toy.name == "toy_plugin"
    task = build_task("toy_plugin", {"n": 4})
    samples = task.load()
    assert [s.sample_id for s in samples] == ["t0", "t1", "t2", "t3"]
    assert task.aggregate([task.score(s, str(s.reference)) for s in samples])["accuracy"] == 1.0


def test_broken_plugin_is_one_line(isolated_registry, monkeypatch):
    class Broken:
        name = "broken"
        value = "nowhere:Nothing"

        def load(self):
            raise ImportError("No module named 'nowhere'")

    monkeypatch.setattr(generic, "entry_points", lambda group: [Broken()])
    monkeypatch.setattr(registry.TASKS, "loaded", False)
    with pytest.raises(KvleagueError, match=r"entry point broken=nowhere:Nothing in group kvleague.tasks failed"):
        available_tasks()


def test_task_families_resolve_prefixed_names(isolated_registry):
    toy = _toy_task_class()
    seen = []

    def resolve(rest):
        seen.append(rest)
        return toy

    register_task_family("toyfam", resolve)
    assert task_class("toyfam:anything") is toy and seen == ["anything"]
    with pytest.raises(KvleagueError, match=r"toyfam:<name>"):
        task_class("nofam:x")


def test_load_is_deterministic_and_seeded():
    task = build_task("gsm8k")
    full = task.load(data_dir=DATA_DIR)
    assert [s.sample_id for s in full[:3]] == ["0", "1", "2"]
    a = task.load(limit=25, seed=5, data_dir=DATA_DIR)
    assert [s.sample_id for s in a] == [s.sample_id for s in task.load(limit=25, seed=5, data_dir=DATA_DIR)]
    assert [s.sample_id for s in a] == sorted(s.sample_id for s in a)
    assert {s.sample_id for s in a} != {s.sample_id for s in task.load(limit=25, seed=6, data_dir=DATA_DIR)}
    assert len(task.load(limit=5000, data_dir=DATA_DIR)) == 1319
    assert task.load(limit=0, data_dir=DATA_DIR) == []
    with pytest.raises(KvleagueError, match="limit"):
        task.load(limit=-1, data_dir=DATA_DIR)


def test_data_dir_from_environment(monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(DATA_DIR))
    assert resolve_data_dir(None) == DATA_DIR
    assert len(build_task("aime24").load()) == 30
    monkeypatch.delenv(DATA_DIR_ENV)
    assert resolve_data_dir(None) is None
    with pytest.raises(KvleagueError, match="data_dir: .* is not a directory"):
        resolve_data_dir(DATA_DIR / "no-such-folder")


@pytest.mark.parametrize(
    "name,hub,local",
    [
        ("math500", "HuggingFaceH4/MATH-500", "math500/test.jsonl"),
        ("humaneval", "openai/openai_humaneval", "humaneval/HumanEval.jsonl.gz"),
        ("leval_quality", "L4NLP/LEval", "leval/Closed-ended-tasks/quality.jsonl"),
        (
            "kv_retrieval_75",
            "not on the Hugging Face Hub",
            "lost_in_the_middle/kv_retrieval_data/kv-retrieval-75_keys.jsonl.gz",
        ),
        ("niah", "not on the Hugging Face Hub", "paul_graham_essays/essays"),
    ],
)
def test_missing_dataset_is_one_line(tmp_path, monkeypatch, name, hub, local):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing to fall back on
    task = build_task(name)
    with pytest.raises(KvleagueError) as err:
        task.load(data_dir=tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert task.source.dataset in msg and hub in msg and str(tmp_path / local) in msg


class _ToyTokenizer:
    """Whitespace tokenizer with an optional chat template rendered by hand (independent check)."""

    def __init__(self, chat: bool):
        self.vocab: dict[str, int] = {}
        self.chat_template = "toy" if chat else None
        self.rendered: list[str] = []

    def _ids(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 10) for w in text.split()]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + self._ids(text)}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages) + (
            " <assistant>" if add_generation_prompt else ""
        )
        self.rendered.append(text)
        return {"input_ids": self._ids(text)}


def test_build_prompt_uses_the_chat_template_when_there_is_one():
    task = build_task("aime24")
    sample = task.load(data_dir=DATA_DIR)[0]
    chat = _ToyTokenizer(chat=True)
    ids = task.build_prompt(sample, chat)
    assert chat.rendered == [f"<user> {sample.prompt} <assistant>"]
    assert ids == chat._ids(chat.rendered[0])
    plain = _ToyTokenizer(chat=False)
    ids = task.build_prompt(sample, plain)
    assert ids == [1] + plain._ids(sample.prompt)


def test_build_prompt_with_a_real_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["Please reason step by step"] * 4,
        trainers.BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    task = build_task("gsm8k")
    sample = task.load(limit=1, data_dir=DATA_DIR)[0]
    assert task.build_prompt(sample, fast) == fast(sample.prompt)["input_ids"]
    fast.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    expected = fast(f"[user]{sample.prompt}\n[assistant]", add_special_tokens=False)["input_ids"]
    assert task.build_prompt(sample, fast) == expected


def test_chat_message_prompts_pass_through():
    task = build_task("aime24")
    s = Sample(
        sample_id="x",
        task="aime24",
        prompt=[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        reference="1",
    )
    assert task.messages(s) == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert task.prompt_text(s) == "S\n\nU"


def test_score_result_and_description_are_json_ready():
    r = ScoreResult(correct=True, score=1.0, extracted="4", details={"gold": "4"}, sample_id="s")
    assert json.loads(json.dumps(r.to_dict())) == {
        "correct": True,
        "score": 1.0,
        "extracted": "4",
        "details": {"gold": "4"},
        "sample_id": "s",
    }
    d = available_tasks()["niah"].describe()
    assert d["domain"] == "longqa" and d["metric"] == "accuracy"
    assert {o["name"] for o in d["options"]} >= {"context_length", "depth", "seed", "tokenizer"}
