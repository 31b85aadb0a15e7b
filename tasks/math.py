"""Math tasks: MATH-500, AIME 2024, AIME 2025, GSM8K.

Every prompt ends with :data:`MATH_SUFFIX`. The answer is the content of the **last**
``\\boxed{...}`` (or ``\\fbox{...}``) in the completion, nested braces handled. Comparison:

* ``math500``: symbolic equivalence with ``math-verify`` (gold and prediction both parsed as LaTeX),
  plus an exact match of the normalized strings (for textual answers math-verify cannot parse);
* ``aime24``/``aime25``: integers (``"025" == 25``);
* ``gsm8k``: numbers (the gold is what follows ``####``); without a box the completion's own
  ``#### x`` line, else its last number, is the answer (the usual "flexible extract").
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.data import load_records
from kvleague.tasks.registry import register_task

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed_span(text: str) -> tuple[int, int] | None:
    """``(start, end)`` of the content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text``
    (nested braces handled); ``None`` when there is none or the last one is never closed."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace is content
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return start, i
        i += 1
    return None  # the last box is unterminated (e.g. a truncated completion)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text`` (stripped), or ``None``."""
    span = last_boxed_span(text)
    if span is not None:
        return text[span[0] : span[1]].strip()
    if _BOX_RE.search(text):
        return None
    # ``\\boxed 5`` (no braces) is valid LaTeX for a single token
    found = re.findall(r"\\boxed\s+([^\s$]+)", text)
    return found[-1].strip() if found else None


_STRIP_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def normalize_answer(s: str) -> str:
    """Light LaTeX normalization for string comparison of final answers."""
    s = s.strip().strip("$").strip()
    s = _STRIP_WRAPPERS.sub(r"\1", s)
    for a, b in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("dfrac", "frac"),
        ("tfrac", "frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\%", ""),
        ("\\$", ""),
        ("$", ""),
    ):
        s = s.replace(a, b)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def math_equal(gold: str, pred: str) -> bool:
    """``True`` when ``pred`` equals ``gold``: normalized strings, else math-verify's symbolic check."""
    if normalize_answer(gold) == normalize_answer(pred):
        return True
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works in the main thread.
    timeout = 5 if _in_main_thread() else None
    g = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]  # None: no alarm
    p = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)  # pyright: ignore[reportArgumentType]
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=timeout))


_NUM_RE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def parse_number(s: str) -> Fraction | None:
    """A plain number (``1,000``, ``-3.50``, ``$18``, ``\\frac{3}{4}``, ``25\\%``) or ``None``."""
    t = s.strip()
    t = _STRIP_WRAPPERS.sub(r"\1", t)
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "^\\circ", "^{\\circ}", " "):
        t = t.replace(junk, "")
    t = t.rstrip(".")
    m = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(-?\d+)\}", t)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    m = re.fullmatch(r"(-?\d+)/(\d+)", t)
    if m and int(m.group(2)):
        return Fraction(int(m.group(1)), int(m.group(2)))
    if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+", t):
        return Fraction(t.replace(",", ""))
    return None


def last_number(text: str) -> str | None:
    found = _NUM_RE.findall(text)
    return found[-1].rstrip(".") if found else None


class _MathTask(Task):
    domain: ClassVar[str] = "math"
    metric: ClassVar[str] = "accuracy"
    max_new_tokens: ClassVar[int] = 2048

    def _prompt(self, problem: str) -> str:
        return f"{problem.strip()}\n\n{MATH_SUFFIX}"

    def reference_continuation(self, sample: Sample) -> str | None:
        """The dataset's worked solution, ending in the boxed answer the prompt asks for (stated once
        more at the end when the solution's own last box is not it: AIME solutions often end in a
        signature or a second method)."""
        solution = (sample.metadata.get("solution") or "").strip()
        if not solution:
            return None
        if not self.score(sample, solution).correct:
            solution += f"\n\nThe final answer is $\\boxed{{{sample.reference}}}$."
        return solution


@register_task("math500")
@dataclass
class Math500(_MathTask):
    """MATH-500 (PRM800K test subset), symbolic comparison with math-verify."""

    source: ClassVar[DataSource] = DataSource(
        dataset="MATH-500",
        hub_id="HuggingFaceH4/MATH-500",
        revision="6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
        local_path="math500/test.jsonl",
        license="MIT",
    )
    size: ClassVar[int] = 500
    scorer_version: ClassVar[str] = "math-verify-0.9/1"

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        return [
            Sample(
                sample_id=row["unique_id"],
                task=self.name,
                prompt=self._prompt(row["problem"]),
                reference=row["answer"],
                metadata={"subject": row.get("subject"), "level": row.get("level"), "solution": row.get("solution")},
            )
            for row in load_records(self.source, data_dir)
        ]

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        pred = last_boxed(completion)
        ok = pred is not None and math_equal(str(sample.reference), pred)
        return ScoreResult(
            correct=ok, score=float(ok), extracted=pred, sample_id=sample.sample_id, details={"gold": sample.reference}
        )


def aime_integer(s: str) -> int | None:
    """The integer an AIME answer string denotes (``"025"``, ``"25"``, ``"\\text{25}"``), else None."""
    n = parse_number(s)
    if n is None or n.denominator != 1:
        return None
    return int(n)


class _Aime(_MathTask):
    max_new_tokens: ClassVar[int] = 4096
    scorer_version: ClassVar[str] = "int/1"
    size: ClassVar[int] = 30

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        pred = last_boxed(completion)
        value = aime_integer(pred) if pred is not None else None
        ok = value is not None and value == aime_integer(str(sample.reference))
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=pred,
            sample_id=sample.sample_id,
            details={"gold": sample.reference, "value": value},
        )


@register_task("aime24")
@dataclass
class Aime24(_Aime):
    """AIME 2024 I and II (30 problems), integer answers."""

    source: ClassVar[DataSource] = DataSource(
        dataset="AIME 2024",
        hub_id="HuggingFaceH4/aime_2024",
        revision="2fe88a2f1091d5048c0f36abc874fb997b3dd99a",
        local_path="aime2024/test.jsonl",
        license="MIT (harness); problems (c) MAA",
        hub_split="train",
    )

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        return [
            Sample(
                sample_id=str(row["id"]),
                task=self.name,
                prompt=self._prompt(row["problem"]),
                reference=str(row["answer"]),
                metadata={"url": row.get("url"), "solution": row.get("solution")},
            )
            for row in load_records(self.source, data_dir)
        ]


@register_task("aime25")
@dataclass
class Aime25(_Aime):
    """AIME 2025 I and II (30 problems), integer answers. Ids are ``I-1`` .. ``II-15`` (dataset order)."""

    source: ClassVar[DataSource] = DataSource(
        dataset="AIME 2025",
        hub_id="math-ai/aime25",
        revision="563bb8404243c5f09de6ec262f2db674fe5bce9b",
        local_path="aime2025/test.jsonl",
        license="MIT (harness); problems (c) MAA",
    )

    @classmethod
    def has_reference(cls) -> bool:
        return False  # the dataset gives answers only, no worked solutions

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        rows = load_records(self.source, data_dir)
        out = []
        for i, row in enumerate(rows):
            contest = "I" if i < 15 else "II"
            out.append(
                Sample(
                    sample_id=f"{contest}-{i % 15 + 1}",
                    task=self.name,
                    prompt=self._prompt(row["problem"]),
                    reference=str(row["answer"]),
                    metadata={},
                )
            )
        return out


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K worked solution (the text after ``####``)."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


@register_task("gsm8k")
@dataclass
class Gsm8k(_MathTask):
    """GSM8K test split (1,319 grade-school word problems), numeric comparison."""

    source: ClassVar[DataSource] = DataSource(
        dataset="GSM8K",
        hub_id="openai/gsm8k",
        revision="cc7b047b6e5bb11b4f1af84efc572db110a51b3c",
        local_path="gsm8k/test.jsonl",
        license="MIT",
        hub_config="main",
    )
    size: ClassVar[int] = 1319
    max_new_tokens: ClassVar[int] = 1024
    scorer_version: ClassVar[str] = "number/1"

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        return [
            Sample(
                sample_id=str(i),
                task=self.name,
                prompt=self._prompt(row["question"]),
                reference=gsm8k_gold(row["answer"]),
                metadata={"solution": row["answer"]},
            )
            for i, row in enumerate(load_records(self.source, data_dir))
        ]

    def reference_continuation(self, sample: Sample) -> str | None:
        """The worked solution without its calculator annotations (``<<48/2=24>>``), its ``#### 72``
        line written as the boxed answer the prompt asks for."""
        steps = re.sub(r"<<[^>]*>>", "", sample.metadata["solution"]).rsplit("####", 1)[0].strip()
        return f"{steps}\nThe final answer is $\\boxed{{{sample.reference}}}$."

    @staticmethod
    def extract(completion: str) -> tuple[str | None, str]:
        boxed = last_boxed(completion)
        if boxed is not None:
            return boxed, "boxed"
        if "####" in completion:
            tail = completion.rsplit("####", 1)[1]
            num = _NUM_RE.search(tail)
            if num:
                return num.group(0).rstrip("."), "hash"
        num = last_number(completion)
        return (num, "last_number") if num is not None else (None, "none")

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        pred, how = self.extract(completion)
        gold = parse_number(str(sample.reference))
        value = parse_number(pred) if pred is not None else None
        ok = value is not None and gold is not None and value == gold
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=pred,
            sample_id=sample.sample_id,
            details={"gold": sample.reference, "extraction": how},
        )
