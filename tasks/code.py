"""Code tasks: HumanEval (164), MBPP sanitized test split (257) and MBPP full test split (500).

The program is pulled out of the completion (:func:`extract_code`: the fenced block that defines the
entry point, else the first fenced block, else the raw text), joined with the task's tests and run
in :mod:`tasks.sandbox` (one contained process per completion). A sample passes when the whole
program runs to its end: the sandbox's proof comes back only when the last statement (HumanEval's
``check(entry_point)``, MBPP's last assert) returned, so ``os._exit(0)``, ``sys.exit(0)`` or a killed
parent fail. Every call of the completion's functions in the tests is wrapped by :data:`PLAIN_SOURCE`,
which turns the result into plain built-in values read through the built-in types' own methods: a
``float`` subclass is its float value, its forged ``__eq__``/``__sub__`` are never called, and an
object of a class the completion defined is not an answer. :meth:`CodeTask.aggregate` reports pass@1 and, with several completions per
sample, the unbiased pass@k estimator of Chen et al. (2021).
"""

from __future__ import annotations

import ast
import os
import re
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any, ClassVar

from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.data import load_records
from kvleague.tasks.registry import register_task
from kvleague.tasks.sandbox import SandboxLimits, SandboxResult, run_many

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The program in ``completion``: among fenced blocks (python/py/unlabelled; an unterminated
    last fence counts, as in a truncated completion) the first that defines ``entry_point``, else the
    first one; without fences the raw completion."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(completion)]
    blocks = [body for lang, body in blocks if lang in ("", "python", "py", "python3")] or [b for _, b in blocks]
    if not blocks:
        return completion
    if entry_point:
        pattern = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
        for body in blocks:
            if pattern.search(body):
                return body
    return blocks[0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


#: the answer filter put before the tests (``{name}`` is random per program): the value of a result
#: in built-in types, read with the built-in types' own methods (never the result's); objects of
#: immutable (C) types stay (their comparisons are C code), iterators yield filtered items, numpy's
#: scalars become their Python value; an object of a Python class (the program's own) is refused
PLAIN_SOURCE = """
def {name}(value, _depth=0, _type=type, _isinstance=isinstance, _flags=type.__dict__["__flags__"].__get__):
    if _depth > 200:
        raise TypeError("kvleague: answer nested too deeply")
    kind = _type(value)
    if value is None or kind is bool:
        return value
    if _isinstance(value, int):
        return int.__index__(value)
    if _isinstance(value, float):
        return float.__float__(value)
    if _isinstance(value, complex):
        return complex(complex.real.__get__(value), complex.imag.__get__(value))
    if _isinstance(value, str):
        return str.__str__(value)
    if _isinstance(value, (bytes, bytearray)):
        return bytes.__bytes__(value) if _isinstance(value, bytes) else bytes(bytearray.__iter__(value))
    if _isinstance(value, list):
        return [{name}(v, _depth + 1) for v in list.__iter__(value)]
    if _isinstance(value, tuple):
        return tuple({name}(v, _depth + 1) for v in tuple.__iter__(value))
    if _isinstance(value, frozenset):
        return frozenset({name}(v, _depth + 1) for v in frozenset.__iter__(value))
    if _isinstance(value, set):
        return {{{name}(v, _depth + 1) for v in set.__iter__(value)}}
    if _isinstance(value, dict):
        return {{{name}(k, _depth + 1): {name}(v, _depth + 1) for k, v in dict.items(value)}}
    if _flags(kind) & 256:  # an immutable (C) type (read from the type slot itself): its methods are fixed
        if hasattr(kind, "__next__"):  # an iterator, a generator: its items are answers too
            return ({name}(v, _depth + 1) for v in value)
        if getattr(kind, "__module__", "") == "numpy":
            if kind.__name__ != "ndarray":
                return {name}(value.item(), _depth + 1)
            if value.dtype.kind == "O":
                raise TypeError("kvleague: an answer of numpy objects is not a built-in value")
        return value
    raise TypeError("kvleague: an answer of type " + repr(getattr(kind, "__qualname__", "?")) + " is not a built-in value")
"""


class _WrapCalls(ast.NodeTransformer):
    """``f(...)`` -> ``plain(f(...))`` for every call of one of ``names``."""

    def __init__(self, names: set[str], plain: str):
        self.names, self.plain = names, plain

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.names:
            return ast.copy_location(ast.Call(ast.Name(self.plain, ast.Load()), [node], []), node)
        return node


def plain_tests(code: str, tests: str, extra: Sequence[str] = ()) -> str:
    """``tests`` with every call of a function ``code`` defines at top level (and of ``extra``
    names) wrapped in a fresh :data:`PLAIN_SOURCE` filter, which is defined first."""
    with warnings.catch_warnings():  # invalid escapes in a task's strings are the program's to report
        warnings.simplefilter("ignore")
        try:
            defined = {n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        except SyntaxError:  # the program fails anyway; its tests stay as they are
            defined = set()
        tree = ast.parse(tests)
    name = f"_kvleague_plain_{secrets.token_hex(6)}"
    tree = _WrapCalls(defined | set(extra), name).visit(tree)
    return PLAIN_SOURCE.format(name=name) + "\n" + ast.unparse(ast.fix_missing_locations(tree)) + "\n"


class CodeTask(Task):
    domain: ClassVar[str] = "code"
    metric: ClassVar[str] = "pass@1"
    max_new_tokens: ClassVar[int] = 1024
    scorer_version: ClassVar[str] = "sandbox/2"  # 2: proof of completion, plain answers
    #: parallel sandbox runs when scoring batches (one more than the cores: runs also wait on the OS)
    workers: ClassVar[int] = min(8, (os.cpu_count() or 1) + 1)

    # Subclasses declare the option ``timeout_s: float = 10.0`` (seconds per program, wall clock).
    timeout_s: float

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    # -- to implement --
    def program(self, sample: Sample, code: str) -> str:
        raise NotImplementedError

    def entry_point(self, sample: Sample) -> str | None:
        return sample.metadata.get("entry_point")

    # -- scoring --
    def limits(self) -> SandboxLimits:
        return SandboxLimits(timeout_s=self.timeout_s)

    def _result(self, sample: Sample, code: str, run: SandboxResult) -> ScoreResult:
        ok = run.passed
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=code,
            sample_id=sample.sample_id,
            details={
                "status": run.status,
                "returncode": run.returncode,
                "stderr": run.stderr[-2000:],
                "duration_s": round(run.duration_s, 4),
                "isolation": run.isolation,
            },
        )

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        return self.score_many([(sample, completion)])[0]

    def score_many(self, pairs: Sequence[tuple[Sample, str]]) -> list[ScoreResult]:
        codes = [extract_code(completion, self.entry_point(sample)) for sample, completion in pairs]
        programs = [self.program(sample, code) for (sample, _), code in zip(pairs, codes)]
        runs = run_many(programs, self.limits(), workers=self.workers)
        return [self._result(sample, code, run) for (sample, _), code, run in zip(pairs, codes, runs)]

    def aggregate(self, results: Sequence[ScoreResult]) -> dict[str, Any]:
        """Adds ``pass@1`` (mean over samples of the fraction of passing completions) and
        ``pass@k`` for k in 5, 10, ... up to the smallest number of completions per sample."""
        out = super().aggregate(results)
        groups: dict[str, list[bool]] = {}
        for i, r in enumerate(results):
            groups.setdefault(r.sample_id or f"#{i}", []).append(bool(r.correct))
        if not groups:
            out["pass@1"] = 0.0
            return out
        n_min = min(len(v) for v in groups.values())
        for k in (1, 5, 10, 20, 50, 100):
            if k > n_min:
                break
            out[f"pass@{k}"] = sum(pass_at_k(len(v), sum(v), k) for v in groups.values()) / len(groups)
        return out


def _humaneval_prompt(code_prompt: str) -> str:
    return (
        "Complete the following Python function. Reply with the complete function (including the "
        "signature and any imports it needs) in a single ```python code block.\n\n"
        f"```python\n{code_prompt.strip()}\n```"
    )


@register_task("humaneval")
@dataclass
class HumanEval(CodeTask):
    """HumanEval (164 hand-written Python problems), pass@k in the sandbox."""

    source: ClassVar[DataSource] = DataSource(
        dataset="HumanEval",
        hub_id="openai/openai_humaneval",
        revision="7dce6050a7d6d172f3cc5c32aa97f52fa1a2e544",
        local_path="humaneval/HumanEval.jsonl.gz",
        license="MIT",
    )
    size: ClassVar[int] = 164
    timeout_s: float = 10.0

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        return [
            Sample(
                sample_id=row["task_id"],
                task=self.name,
                prompt=_humaneval_prompt(row["prompt"]),
                reference=row["canonical_solution"],
                metadata={"entry_point": row["entry_point"], "code_prompt": row["prompt"], "test": row["test"]},
            )
            for row in load_records(self.source, data_dir)
        ]

    def reference_continuation(self, sample: Sample) -> str | None:
        """The complete function the prompt asks for: its stub with the canonical body, in one block."""
        return f"```python\n{sample.metadata['code_prompt'].rstrip()}\n{sample.reference.rstrip()}\n```"

    def program(self, sample: Sample, code: str) -> str:
        """Prompt context (imports, helpers) + the function + HumanEval's ``check(entry_point)``.

        A completion that defines the entry point replaces the prompt's stub; one that does not is
        taken as the body that continues the prompt (the classic completion format)."""
        prompt: str = sample.metadata["code_prompt"]
        entry = sample.metadata["entry_point"]
        if _defines(code, entry):
            m = re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", prompt, re.M)
            head = prompt[: m.start()] if m else ""
            body = f"{head}\n{code}"
        else:
            body = prompt + code
        tests = plain_tests(code, sample.metadata["test"], ["candidate"])
        return f"{body}\n\n{tests}\ncheck({entry})\n"


def _mbpp_prompt(text: str, tests: list[str]) -> str:
    return (
        f"You are an expert Python programmer, and here is your task: {text.strip()} "
        "Your code should pass these tests:\n\n"
        + "\n".join(tests)
        + "\n\nReply with the complete Python code in a single ```python code block."
    )


def _mbpp_entry_point(code: str, tests: list[str]) -> str | None:
    """The function of the reference code that the tests call."""
    joined = "\n".join(tests)
    for name in re.findall(r"^\s*def\s+([A-Za-z_]\w*)\s*\(", code, re.M):
        if re.search(rf"\b{re.escape(name)}\s*\(", joined):
            return name
    return None


class _MbppBase(CodeTask):
    size: ClassVar[int]
    _split_ids: ClassVar[range] = range(11, 511)  # MBPP test split: task ids 11..510
    _text_field: ClassVar[str]

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        out = []
        for row in load_records(self.source, data_dir):
            tid = int(row["task_id"])
            if tid not in self._split_ids:
                continue
            tests = list(row["test_list"])
            setup = row.get("test_setup_code") or ""
            imports = "\n".join(row.get("test_imports") or [])
            out.append(
                Sample(
                    sample_id=str(tid),
                    task=self.name,
                    prompt=_mbpp_prompt(row[self._text_field], tests),
                    reference=row["code"],
                    metadata={
                        "tests": tests,
                        "imports": imports,
                        "setup": setup,
                        "entry_point": _mbpp_entry_point(row["code"], tests),
                    },
                )
            )
        out.sort(key=lambda s: int(s.sample_id))
        return out

    def reference_continuation(self, sample: Sample) -> str | None:
        """The reference code, in the single block the prompt asks for."""
        return f"```python\n{sample.reference.strip()}\n```"

    def program(self, sample: Sample, code: str) -> str:
        """``test_imports`` + the code + ``test_setup_code`` (it may use the code's classes) + the
        asserts of ``test_list``."""
        tests = plain_tests(code, "\n".join(sample.metadata["tests"]))
        parts = [sample.metadata["imports"], code, sample.metadata["setup"], tests]
        return "\n\n".join(p for p in parts if p) + "\n"


@register_task("mbpp")
@dataclass
class Mbpp(_MbppBase):
    """MBPP sanitized (hand-verified) test split, 257 problems, pass@k in the sandbox."""

    source: ClassVar[DataSource] = DataSource(
        dataset="MBPP (sanitized)",
        hub_id="google-research-datasets/mbpp",
        revision="4bb6404fdc6cacfda99d4ac4205087b89d32030c",
        local_path="mbpp/sanitized-mbpp.json",
        license="CC-BY-4.0",
        hub_config="sanitized",
    )
    size: ClassVar[int] = 257
    _text_field: ClassVar[str] = "prompt"
    timeout_s: float = 10.0


@register_task("mbpp_full")
@dataclass
class MbppFull(_MbppBase):
    """MBPP full test split (task ids 11-510, 500 problems), pass@k in the sandbox."""

    source: ClassVar[DataSource] = DataSource(
        dataset="MBPP (full)",
        hub_id="google-research-datasets/mbpp",
        revision="4bb6404fdc6cacfda99d4ac4205087b89d32030c",
        local_path="mbpp/mbpp.jsonl",
        license="CC-BY-4.0",
        hub_config="full",
    )
    size: ClassVar[int] = 500
    _text_field: ClassVar[str] = "text"
    timeout_s: float = 10.0
