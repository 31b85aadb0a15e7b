"""Long-document QA: L-Eval, Lost-in-the-Middle key-value retrieval and LongBench QA subsets (Hub
only); the needle in a haystack is :mod:`tasks.niah`.

The long context is the prompt, so every task here sets ``protect_prompt = False`` (the runner uses
prefill compression).

Scorers:

* L-Eval exam files (``leval_quality``, ``leval_tpo``, ``leval_coursera``: option letters, a set for
  Coursera's multi-answer questions; ``leval_sci_fi``: True/False as stated by the document;
  ``leval_topic_retrieval``: the gold topic appears in the answer; ``leval_gsm100``: numbers), accuracy;
* L-Eval open QA files with gold answers (``leval_scientific_qa``, ``leval_multidoc_qa``,
  ``leval_natural_question``, ``leval_financial_qa``, ``leval_legal_contract_qa``): SQuAD token F1
  (``correct`` is normalized exact match);
* ``kv_retrieval_75`` / ``kv_retrieval_140``: the gold value (a UUID) appears in the answer;
* ``longbench_*``: LongBench's ``qa_f1_score`` (max over the gold answers).
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.data import load_records
from kvleague.tasks.math import Gsm8k, parse_number
from kvleague.tasks.registry import register_task

# ------------------------------------------------------------------------------------------------
# metrics


def normalize_squad(text: str) -> str:
    """SQuAD answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str, *, empty_equal: bool = True) -> float:
    """Token-level F1 between the normalized strings. Two empty answers score ``empty_equal``."""
    pred = normalize_squad(prediction).split()
    ref = normalize_squad(gold).split()
    if not pred and not ref:
        return 1.0 if empty_equal else 0.0
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred)
    recall = same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_squad(prediction) == normalize_squad(gold)


def longbench_qa_f1(prediction: str, answers: Sequence[str]) -> float:
    """LongBench ``qa_f1_score`` for one prediction: max over gold answers of the token F1 of the
    normalized strings (an empty overlap, including two empty strings, scores 0)."""
    return max((token_f1(prediction, a, empty_equal=False) for a in answers), default=0.0)


def longbench_score(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """LongBench's reported number for a QA subset: 100 x mean of :func:`longbench_qa_f1`, 2 decimals."""
    if not predictions:
        return 0.0
    total = sum(longbench_qa_f1(p, a) for p, a in zip(predictions, answers, strict=True))
    return round(100 * total / len(predictions), 2)


_LETTERS = "ABCD"


_RUN = r"([A-D](?:(?:\s*[,;/&]\s*|\s+and\s+|\s*\)?\s*\(?)[A-D])*)\)?(?=$|[^A-Za-z0-9])"


def extract_choices(text: str, multi: bool = False) -> frozenset[str]:
    """Option letters (A-D, upper case) chosen in ``text``: a leading run (``"B"``, ``"(B) ..."``,
    ``"ABD"``, ``"A, C and D"``), else the run after "answer is/are/:", else the first ``(X)``.
    Single-answer mode keeps only the first letter of the run."""
    t = text.strip()
    m = re.match(r"^[^A-Za-z0-9]*" + _RUN, t)
    if m is None:
        m = re.search(r"(?i:answers?)\s*(?:(?i:is|are)\s*)?:?\s*(?:(?i:options?)\s*)?\(?" + _RUN, t)
    if m is None:
        m = re.search(r"\(([A-D])\)", t)
    if m is None:
        return frozenset()
    found = re.findall(r"[A-D]", m.group(1))
    return frozenset(found if multi else found[:1])


def extract_true_false(text: str) -> str | None:
    m = re.search(r"\b(true|false)\b", text, re.I)
    return m.group(1).capitalize() if m else None


# ------------------------------------------------------------------------------------------------
# L-Eval

_LEVAL = DataSource(
    dataset="L-Eval",
    hub_id="L4NLP/LEval",
    revision="main",  # unpinned: no Hub access to resolve a commit when this was written
    local_path="leval",
    license="GPL-3.0 (repository); sources vary",
    url="https://github.com/OpenLMLab/LEval/tree/cd34b050269148aed75acbbe4a599873ad0f37e9/LEval-data",
)


def _leval_source(name: str, file: str, hub_path: str) -> DataSource:
    """L-Eval file ``file`` (local layout ``leval/<file>``; ``hub_path`` in the Hub repository)."""
    return DataSource(
        dataset=f"L-Eval {name}",
        hub_id=_LEVAL.hub_id,
        revision=_LEVAL.revision,
        local_path=f"leval/{file}",
        license=_LEVAL.license,
        hub_file=hub_path,
        url=_LEVAL.url,
    )


class _LEvalTask(Task):
    domain: ClassVar[str] = "longqa"
    protect_prompt: ClassVar[bool] = False
    max_new_tokens: ClassVar[int] = 64
    file: ClassVar[str]  # path under the L-Eval folder, e.g. "Closed-ended-tasks/quality.jsonl"
    hub_path: ClassVar[str]  # path in the L4NLP/LEval Hub repository
    instruction: ClassVar[str] = "Answer the question based on the document."

    def gold(self, output: str) -> Any:
        return output.strip()

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        samples = []
        for d, row in enumerate(load_records(self.source, data_dir)):
            for q, (question, output) in enumerate(zip(row["instructions"], row["outputs"], strict=True)):
                samples.append(
                    Sample(
                        sample_id=f"{d}-{q}",
                        task=self.name,
                        prompt=self.render(row["input"], question),
                        reference=self.gold(output),
                        metadata={"raw_answer": output, "doc_index": d, "source": row.get("source")},
                    )
                )
        return samples

    def reference_continuation(self, sample: Sample) -> str | None:
        """The dataset's gold answer as written (a letter for choice tasks, the answer text otherwise)."""
        return str(sample.metadata.get("raw_answer") or "").strip() or None

    def render(self, document: str, question: str) -> str:
        return (
            f"Read the document below and answer the question that follows.\n\nDocument:\n{document.strip()}\n\n"
            f"Question: {question.strip()}\n\n{self.instruction}"
        )


class _LEvalChoice(_LEvalTask):
    metric: ClassVar[str] = "accuracy"
    scorer_version: ClassVar[str] = "choice/1"
    multi: ClassVar[bool] = False
    max_new_tokens: ClassVar[int] = 16
    instruction: ClassVar[str] = "Answer with the letter of the correct option only."

    def gold(self, output: str) -> str:
        chosen = extract_choices(output, multi=self.multi)
        if not chosen:
            raise KvleagueError(f"task {self.name}: cannot read the gold option letters from {output[:40]!r}")
        return "".join(sorted(chosen))

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        chosen = "".join(sorted(extract_choices(completion, multi=self.multi)))
        ok = chosen == sample.reference
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=chosen or None,
            sample_id=sample.sample_id,
            details={"gold": sample.reference},
        )


@register_task("leval_quality")
@dataclass
class LEvalQuality(_LEvalChoice):
    """L-Eval QuALITY: multiple choice over long stories (202 questions), accuracy."""

    file: ClassVar[str] = "Closed-ended-tasks/quality.jsonl"
    source: ClassVar[DataSource] = _leval_source(
        "quality", "Closed-ended-tasks/quality.jsonl", "LEval/Exam/quality.jsonl"
    )
    size: ClassVar[int] = 202


@register_task("leval_tpo")
@dataclass
class LEvalTpo(_LEvalChoice):
    """L-Eval TOEFL TPO: multiple choice over lecture transcripts (269 questions), accuracy."""

    file: ClassVar[str] = "Closed-ended-tasks/tpo.jsonl"
    source: ClassVar[DataSource] = _leval_source("tpo", "Closed-ended-tasks/tpo.jsonl", "LEval/Exam/tpo.jsonl")
    size: ClassVar[int] = 269


@register_task("leval_coursera")
@dataclass
class LEvalCoursera(_LEvalChoice):
    """L-Eval Coursera: multiple choice with one or more correct options (172 questions), exact-set accuracy."""

    file: ClassVar[str] = "Closed-ended-tasks/coursera.jsonl"
    source: ClassVar[DataSource] = _leval_source(
        "coursera", "Closed-ended-tasks/coursera.jsonl", "LEval/Exam/coursera.jsonl"
    )
    size: ClassVar[int] = 172
    multi: ClassVar[bool] = True
    instruction: ClassVar[str] = (
        "One or more options may be correct. Answer with the letters of all correct options only (for example: AC)."
    )


@register_task("leval_sci_fi")
@dataclass
class LEvalSciFi(_LEvalTask):
    """L-Eval SFGram sci-fi: True/False as stated by the document (64 questions), accuracy."""

    file: ClassVar[str] = "Closed-ended-tasks/sci_fi.jsonl"
    source: ClassVar[DataSource] = _leval_source("sci_fi", "Closed-ended-tasks/sci_fi.jsonl", "LEval/Exam/sci_fi.jsonl")
    size: ClassVar[int] = 64
    max_new_tokens: ClassVar[int] = 8
    scorer_version: ClassVar[str] = "true-false/1"
    instruction: ClassVar[str] = "Answer with True or False only, according to the document."

    def gold(self, output: str) -> str:
        # "True [fact: False]": the first word is the answer within the story's world
        value = extract_true_false(output.split("[", 1)[0])
        if value is None:
            raise KvleagueError(f"task {self.name}: cannot read True/False from gold {output[:40]!r}")
        return value

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        pred = extract_true_false(completion)
        ok = pred == sample.reference
        return ScoreResult(
            correct=ok, score=float(ok), extracted=pred, sample_id=sample.sample_id, details={"gold": sample.reference}
        )


@register_task("leval_topic_retrieval")
@dataclass
class LEvalTopicRetrieval(_LEvalTask):
    """L-Eval LongChat topic retrieval: name the k-th topic of a long chat (150 questions), accuracy."""

    file: ClassVar[str] = "Closed-ended-tasks/topic_retrieval_longchat.jsonl"
    source: ClassVar[DataSource] = _leval_source(
        "topic_retrieval_longchat",
        "Closed-ended-tasks/topic_retrieval_longchat.jsonl",
        "LEval/Exam/topic_retrieval_longchat.jsonl",
    )
    size: ClassVar[int] = 150
    max_new_tokens: ClassVar[int] = 32
    scorer_version: ClassVar[str] = "contains/1"
    instruction: ClassVar[str] = "Answer with the topic name only."

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        gold = normalize_squad(sample.reference)
        pred = normalize_squad(completion)
        ok = bool(gold) and re.search(rf"(?:^| ){re.escape(gold)}(?: |$)", pred) is not None
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=completion.strip() or None,
            sample_id=sample.sample_id,
            details={"gold": sample.reference},
        )


@register_task("leval_gsm100")
@dataclass
class LEvalGsm100(_LEvalTask):
    """L-Eval GSM100: GSM8K questions after 16 long worked examples (100 questions), numeric accuracy."""

    file: ClassVar[str] = "Closed-ended-tasks/gsm100.jsonl"
    source: ClassVar[DataSource] = _leval_source("gsm100", "Closed-ended-tasks/gsm100.jsonl", "LEval/Exam/gsm100.jsonl")
    size: ClassVar[int] = 100
    max_new_tokens: ClassVar[int] = 256
    scorer_version: ClassVar[str] = "number/1"
    instruction: ClassVar[str] = "Solve it step by step like the examples and end with 'The answer is' and the number."

    def render(self, document: str, question: str) -> str:
        return f"{document.strip()}\n\n{question.strip()}"

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        m = re.findall(r"answer is\s*:?\s*\$?\s*(-?[\d,]*\.?\d+)", completion, re.I)
        pred = m[-1] if m else Gsm8k.extract(completion)[0]
        value = parse_number(pred) if pred is not None else None
        ok = value is not None and value == parse_number(str(sample.reference))
        return ScoreResult(
            correct=ok, score=float(ok), extracted=pred, sample_id=sample.sample_id, details={"gold": sample.reference}
        )


class _LEvalF1(_LEvalTask):
    metric: ClassVar[str] = "f1"
    scorer_version: ClassVar[str] = "squad-f1/1"
    max_new_tokens: ClassVar[int] = 256
    instruction: ClassVar[str] = "Answer concisely, using the document's words where possible."

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        pred = completion.strip()
        f1 = token_f1(pred, sample.reference)
        return ScoreResult(
            correct=exact_match(pred, sample.reference),
            score=f1,
            extracted=pred or None,
            sample_id=sample.sample_id,
            details={"gold": sample.reference, "f1": f1},
        )

    def aggregate(self, results: Sequence[ScoreResult]) -> dict[str, Any]:
        out = super().aggregate(results)
        out["f1"] = out["score"]
        out["exact_match"] = out["accuracy"]
        return out


def _f1_task(name: str, file: str, hub: str, size: int, doc: str) -> type[_LEvalF1]:
    cls = type(
        f"LEval_{name}",
        (_LEvalF1,),
        {
            "__doc__": doc,
            "__module__": __name__,
            "__annotations__": {},
            "file": file,
            "source": _leval_source(name, file, hub),
            "size": size,
        },
    )
    return register_task(f"leval_{name}")(dataclass(cls))


_f1_task(
    "scientific_qa",
    "Open-ended-tasks/scientific_qa.jsonl",
    "LEval/Generation/scientific_qa.jsonl",
    184,
    "L-Eval Qasper-based scientific QA (184 questions), token F1.",
)
_f1_task(
    "multidoc_qa",
    "Open-ended-tasks/multidoc_qa.jsonl",
    "LEval/Generation/multidoc_qa.jsonl",
    158,
    "L-Eval multi-document QA (158 questions), token F1.",
)
_f1_task(
    "natural_question",
    "Open-ended-tasks/natural_question.jsonl",
    "LEval/Generation/natural_question.jsonl",
    109,
    "L-Eval Natural Questions over long Wikipedia pages (109 questions), token F1.",
)
_f1_task(
    "financial_qa",
    "Open-ended-tasks/financial_qa.jsonl",
    "LEval/Generation/financial_qa.jsonl",
    68,
    "L-Eval financial earnings-call QA (68 questions), token F1.",
)
_f1_task(
    "legal_contract_qa",
    "Open-ended-tasks/legal_contract_qa.jsonl",
    "LEval/Generation/legal_contract_qa.jsonl",
    154,
    "L-Eval CUAD legal contract QA (154 questions), token F1.",
)


# ------------------------------------------------------------------------------------------------
# Lost in the Middle: key-value retrieval


class _KvRetrieval(Task):
    domain: ClassVar[str] = "longqa"
    protect_prompt: ClassVar[bool] = False
    metric: ClassVar[str] = "accuracy"
    max_new_tokens: ClassVar[int] = 64
    scorer_version: ClassVar[str] = "contains/1"
    size: ClassVar[int] = 500
    keys: ClassVar[int]

    gold_index: int | None  # declared by subclasses (dataclass option)

    def __post_init__(self) -> None:
        if self.gold_index is not None and not 0 <= self.gold_index < self.keys:
            raise ValueError(f"gold_index must be in 0..{self.keys - 1} or None, got {self.gold_index}")

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        samples = []
        for i, row in enumerate(load_records(self.source, data_dir)):
            records = [tuple(kv) for kv in row["ordered_kv_records"]]
            key, value = row["key"], row["value"]
            if self.gold_index is not None:
                records = [kv for kv in records if kv[0] != key]
                records.insert(self.gold_index, (key, value))
            position = [k for k, _ in records].index(key)
            data = json.dumps(dict(records), indent=1)
            prompt = (
                "Extract the value corresponding to the specified key in the JSON object below.\n\n"
                f'JSON data:\n{data}\n\nKey: "{key}"\nCorresponding value:'
            )
            samples.append(
                Sample(
                    sample_id=str(i),
                    task=self.name,
                    prompt=prompt,
                    reference=value,
                    metadata={"key": key, "gold_index": position, "num_keys": len(records)},
                )
            )
        return samples

    def reference_continuation(self, sample: Sample) -> str | None:
        return sample.reference

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        ok = sample.reference.lower() in completion.lower()
        found = re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", completion.lower())
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=found[0] if found else (completion.strip() or None),
            sample_id=sample.sample_id,
            details={"gold": sample.reference},
        )


def _kv_source(keys: int) -> DataSource:
    return DataSource(
        dataset=f"Lost-in-the-Middle KV retrieval ({keys} keys)",
        hub_id=None,
        revision="29b8a6d042ce29abccee3db1a73171a107d7e6af",
        local_path=f"lost_in_the_middle/kv_retrieval_data/kv-retrieval-{keys}_keys.jsonl.gz",
        license="MIT",
        url="https://github.com/nelson-liu/lost-in-the-middle (kv_retrieval_data/, commit 29b8a6d0)",
    )


@register_task("kv_retrieval_75")
@dataclass
class KvRetrieval75(_KvRetrieval):
    """Lost-in-the-Middle key-value retrieval with 75 UUID pairs (500 samples), accuracy."""

    source: ClassVar[DataSource] = _kv_source(75)
    keys: ClassVar[int] = 75
    gold_index: int | None = None


@register_task("kv_retrieval_140")
@dataclass
class KvRetrieval140(_KvRetrieval):
    """Lost-in-the-Middle key-value retrieval with 140 UUID pairs (500 samples), accuracy."""

    source: ClassVar[DataSource] = _kv_source(140)
    keys: ClassVar[int] = 140
    gold_index: int | None = None


# ------------------------------------------------------------------------------------------------
# LongBench (Hub only)

# Prompts are kvleague's own wording; max_new_tokens follow LongBench's per-subset settings.
_PASSAGES = (
    "Use the passages below to answer the question. Reply with the answer alone, no other words.\n\n"
    "Passages:\n{context}\n\nReply with the answer alone, no other words.\n\nQuestion: {input}\nAnswer:"
)
_LONGBENCH_PROMPTS = {
    "narrativeqa": (
        "Below is a story (a novel or a film script) followed by a question. Answer as briefly as possible, "
        "in a single phrase if you can.\n\nStory:\n{context}\n\nAnswer the question about the story "
        "as briefly as possible.\n\nQuestion: {input}\n\nAnswer:",
        128,
    ),
    "qasper": (
        "Below is a scientific paper followed by a question. Answer as briefly as possible, in a single phrase "
        'or sentence if you can. Write "unanswerable" when the paper does not answer it; answer yes/no '
        'questions with "yes", "no" or "unanswerable".\n\nPaper:\n{context}\n\nAnswer the question '
        "about the paper as briefly as possible.\n\nQuestion: {input}\n\nAnswer:",
        128,
    ),
    "multifieldqa_en": (
        "Read the text below and answer the question briefly.\n\n{context}\n\nGive only the answer "
        "to this question about the text.\n\nQuestion: {input}\nAnswer:",
        64,
    ),
    "hotpotqa": (_PASSAGES, 32),
    "2wikimqa": (_PASSAGES, 32),
}
_LONGBENCH_SIZES = {"narrativeqa": 200, "qasper": 200, "multifieldqa_en": 150, "hotpotqa": 200, "2wikimqa": 200}


class _LongBench(Task):
    domain: ClassVar[str] = "longqa"
    protect_prompt: ClassVar[bool] = False
    metric: ClassVar[str] = "f1"
    scorer_version: ClassVar[str] = "longbench-qa-f1/1"
    subset: ClassVar[str]

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        template, _ = _LONGBENCH_PROMPTS[self.subset]
        return [
            Sample(
                sample_id=str(row.get("_id") or i),
                task=self.name,
                prompt=template.format(context=row["context"], input=row["input"]),
                reference=list(row["answers"]),
                metadata={"length": row.get("length")},
            )
            for i, row in enumerate(load_records(self.source, data_dir))
        ]

    def reference_continuation(self, sample: Sample) -> str | None:
        return str(sample.reference[0]) if sample.reference else None

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        answers = list(sample.reference)
        f1 = longbench_qa_f1(completion, answers)
        em = any(exact_match(completion, a) for a in answers)
        return ScoreResult(
            correct=em,
            score=f1,
            extracted=completion.strip() or None,
            sample_id=sample.sample_id,
            details={"gold": answers, "f1": f1},
        )

    def aggregate(self, results: Sequence[ScoreResult]) -> dict[str, Any]:
        out = super().aggregate(results)
        out["f1"] = out["score"]
        out["longbench_score"] = round(100 * out["score"], 2)
        return out


def _longbench_task(subset: str) -> type[_LongBench]:
    template, max_new = _LONGBENCH_PROMPTS[subset]
    cls = type(
        f"LongBench_{subset}",
        (_LongBench,),
        {
            "__doc__": f"LongBench {subset} (Hub only: THUDM/LongBench), LongBench qa_f1_score.",
            "__module__": __name__,
            "__annotations__": {},
            "subset": subset,
            "size": _LONGBENCH_SIZES[subset],
            "max_new_tokens": max_new,
            "source": DataSource(
                dataset=f"LongBench {subset}",
                hub_id="THUDM/LongBench",
                revision="main",
                local_path=f"longbench/{subset}.jsonl",
                license="MIT (LongBench); sources vary",
                hub_file=f"data.zip!data/{subset}.jsonl",
            ),
        },
    )
    return register_task(f"longbench_{subset}")(dataclass(cls))


for _subset in _LONGBENCH_PROMPTS:
    _longbench_task(_subset)
