"""RULER (Hsieh et al., arXiv 2404.06654) built offline by kvleague's own generator: ``ruler_<task>``.

The recipe is RULER's published one (``scripts/data/synthetic``: the prompts, needle counts and kinds,
the haystacks, the answer prefixes, the tokens to generate, and a haystack grown by binary search
until prompt + tokens to generate fill ``context_length`` tokens of the bound tokenizer), written here
anew. Samples carry kvpress's split (``metadata`` ``context`` / ``question`` / ``answer_prefix``, as
kvpress's ``create_huggingface_dataset`` cuts RULER's inputs), so ``protocol: kvpress`` compresses the
context alone. Scoring is RULER's string match: ``string_match_all`` (the share of the references the
answer contains, case-insensitive) for every synthetic task, ``string_match_part`` (any) for QA.

What differs from RULER's own generator and kvpress's released RULER-4k set (docs/tasks.md): words
come from the essays' vocabulary (no ``wonderwords`` adjective-noun lists, no RULER word list),
sentences are cut at ``. ! ?`` (no NLTK punkt), lengths are counted in the model's own tokenizer
(kvpress's set used Llama-3.1-8B's for every model), draws use Python's ``random`` with the task's
seed, and the QA tasks need SQuAD / HotpotQA, which are not in the data directory (refused in one line).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.base import DataSource, Sample, ScoreResult, Task
from kvleague.tasks.niah import Niah, _Chars, _Tokens
from kvleague.tasks.registry import register_task

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
#: RULER's needle depths: 40 evenly spaced percentages of the haystack's sentences
DEPTHS = [round(100 * i / 39) for i in range(40)]
CONTROL = re.compile(r"[\x00-\x1f]")

#: RULER's prompts (``constants.py``): the context part, the question and the answer prefix
PROMPTS = {
    "niah": (
        "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {kind} afterwards.\n{context}\n",
        "What are all the special magic {kind} for {query} mentioned in the provided text?",
        " The special magic {kind} for {query} mentioned in the provided text are",
    ),
    "vt": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n",
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
    ),
    "cwe": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\n",
        "Question: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "fwe": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\n",
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
}
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


@dataclass(frozen=True)
class Variant:
    """One RULER task (``scripts/synthetic.yaml``)."""

    kind: str  # niah, vt, cwe, fwe, qa
    haystack: str = "essay"  # essay, noise, needle
    key: str = "words"
    value: str = "numbers"
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1
    qa_source: str = ""


VARIANTS = {
    "niah_single_1": Variant("niah", haystack="noise"),
    "niah_single_2": Variant("niah"),
    "niah_single_3": Variant("niah", value="uuids"),
    "niah_multikey_1": Variant("niah", n_keys=4),
    "niah_multikey_2": Variant("niah", haystack="needle"),
    "niah_multikey_3": Variant("niah", haystack="needle", key="uuids", value="uuids"),
    "niah_multivalue": Variant("niah", n_values=4),
    "niah_multiquery": Variant("niah", n_queries=4),
    "vt": Variant("vt", haystack="noise"),
    "cwe": Variant("cwe"),
    "fwe": Variant("fwe"),
    "qa_1": Variant("qa", qa_source="SQuAD v2 (dev)"),
    "qa_2": Variant("qa", qa_source="HotpotQA (dev)"),
}


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's per-sample ``string_match_all``: the share of ``references`` found in ``prediction``."""
    text = prediction.lower()
    return sum(r.lower() in text for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's per-sample ``string_match_part``: 1 when any reference is found in ``prediction``."""
    text = prediction.lower()
    return float(any(r.lower() in text for r in references))


def clean(prediction: str) -> str:
    """The answer as RULER scores it: stripped, control characters removed."""
    return CONTROL.sub("", prediction.strip()).strip()


@dataclass
class Ruler(Task):
    """RULER, built offline following RULER's recipe; string match (see the module docstring)."""

    domain: ClassVar[str] = "longqa"
    source: ClassVar[DataSource] = Niah.source
    protect_prompt: ClassVar[bool] = False
    tokenizer_dependent: ClassVar[bool] = True
    metric: ClassVar[str] = "string_match"
    scorer_version: ClassVar[str] = "ruler-string-match/1"
    size: ClassVar[int] = 500
    variant: ClassVar[Variant]

    context_length: int = field(
        default=4096,
        metadata={"unit": "tokens of the model's tokenizer, the tokens to generate included (RULER's max_seq_length)"},
    )
    num_samples: int = 500
    seed: int = 42

    def __post_init__(self) -> None:
        if self.context_length < 256:
            raise ValueError(f"context_length must be >= 256, got {self.context_length}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        self._bound: Any = None

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self._bound = tokenizer

    # ---- generation --------------------------------------------------------------------------------
    def load_records(self, data_dir: Path | None) -> list[Sample]:
        v = self.variant
        if v.kind == "qa":
            raise KvleagueError(
                f"task {self.name}: RULER's QA needs {v.qa_source}, which is not in the data directory "
                "(only the essays are); allowed: the synthetic ruler_* tasks"
            )
        essays = Niah.read_corpus(data_dir)
        measure = _Tokens(self._bound) if self._bound is not None else _Chars()
        gen = _Generator(v, essays, random.Random(f"kvleague-ruler:{self.name}:{self.seed}"), self.context_length)
        budget = self.context_length - self.max_new_tokens

        def length(parts: tuple[str, str, str]) -> int:
            return measure.count("".join(parts))

        size = gen.largest(lambda n: length(gen.parts(n, probe=True)[0]) <= budget)
        samples = []
        for i in range(self.num_samples):
            n = size
            parts, answers = gen.parts(n)
            while length(parts) > budget and n > gen.step:  # an unlucky draw: a smaller haystack
                n -= gen.step
                parts, answers = gen.parts(n)
            if length(parts) > budget:
                raise KvleagueError(
                    f"task {self.name}: context_length {self.context_length} is shorter than RULER's smallest "
                    f"haystack here ({length(parts) + self.max_new_tokens} {measure.unit}); allowed: a longer context_length"
                )
            context, question, prefix = parts
            samples.append(
                Sample(
                    sample_id=f"{self.name}-L{self.context_length}-{i}",
                    task=self.name,
                    prompt=context + question + prefix,
                    reference=answers,
                    metadata={
                        "context": context,
                        "question": question,
                        "answer_prefix": prefix,
                        "length": length(parts) + self.max_new_tokens,
                        "units": measure.unit,
                    },
                )
            )
        return samples

    # ---- scoring -----------------------------------------------------------------------------------
    def score(self, sample: Sample, completion: str) -> ScoreResult:
        match = string_match_part if self.variant.kind == "qa" else string_match_all
        prediction = clean(completion)
        value = match(prediction, list(sample.reference))
        return ScoreResult(
            correct=value == 1.0,
            score=value,
            extracted=prediction,
            sample_id=sample.sample_id,
            details={"gold": list(sample.reference)},
        )

    def aggregate(self, results) -> dict[str, Any]:
        out = super().aggregate(results)
        out["string_match"] = out["score"]  # RULER's metric as a share (kvpress reports it x 100)
        return out


class _Generator:
    """One RULER task's samples: ``parts(n)`` is (context, question, answer prefix) with a haystack of
    ``n`` units (words, sentences or list entries) and its references; ``largest`` the biggest ``n``
    that fits, by binary search as RULER sizes its haystacks."""

    def __init__(self, variant: Variant, essays: str, rng: random.Random, context_length: int):
        self.v, self.rng = variant, rng
        # below 4k tokens RULER grows line haystacks 5 lines at a time and lists each common word 6 times,
        # the others once (30 and 3 above)
        self.short = context_length < 4096
        self.words = essays.split()
        self.vocab = sorted({w for w in re.findall(r"\b[a-z]{4,}\b", essays.lower())})
        # RULER's growth steps: 500 essay words, 25 lines (5 below 4k tokens), 10 words or list entries
        lines = 5 if self.short else 25
        self.step = {"essay": 500, "noise": lines, "needle": lines}[variant.haystack] if variant.kind == "niah" else 10

    def largest(self, fits) -> int:
        low, high, best = self.step, self.step * 2, self.step
        while high < 10**7 and fits(high):  # grow the upper bound first
            best, low, high = high, high, high * 2
        while low <= high:
            mid = (low + high) // 2
            if fits(mid):
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return best

    def parts(self, n: int, probe: bool = False) -> tuple[tuple[str, str, str], list[str]]:
        state = self.rng.getstate()
        out = getattr(self, f"_{self.v.kind}")(n)
        if probe:  # sizing draws nothing: the samples are the same whatever the search tried
            self.rng.setstate(state)
        return out

    def _draw(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(1_000_000, 9_999_999))
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        return f"{self.rng.choice(self.vocab)}-{self.rng.choice(self.vocab)}"

    def _sentences(self, n_words: int) -> list[str]:
        words = (self.words * (n_words // len(self.words) + 1))[:n_words]
        return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(words)) if s]

    def _niah(self, n: int):
        v = self.v
        kind = v.value
        keys, values, needles = [], [], []
        for _ in range(max(v.n_keys, v.n_queries)):
            keys.append(self._draw(v.key))
            values.append([self._draw(v.value) for _ in range(v.n_values)])
            needles += [NEEDLE.format(kind=kind, key=keys[-1], value=value) for value in values[-1]]
        self.rng.shuffle(needles)
        if v.haystack == "essay":
            sents = self._sentences(n)
            cuts = sorted(int(len(sents) * d / 100) for d in self.rng.sample(DEPTHS, len(needles)))
            pieces, last = [], 0
            for cut, needle in zip(cuts, needles):
                pieces += [" ".join(sents[last:cut]), needle]
                last = cut
            context = " ".join(p for p in [*pieces, " ".join(sents[last:])] if p)
        else:
            if v.haystack == "noise":
                lines = [NOISE] * n
            else:
                lines = [NEEDLE.format(kind=kind, key=self._draw(v.key), value=self._draw(v.value)) for _ in range(n)]
            for index, needle in zip(sorted(self.rng.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(index, needle)
            context = "\n".join(lines)
        asked = self.rng.sample(range(len(keys)), v.n_queries)
        queries = [keys[i] for i in asked]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        parts = [p.format(kind=kind, context=context, query=query) for p in PROMPTS["niah"]]
        if v.n_queries * v.n_values == 1:  # RULER's singular wording
            singular = kind[:-1]
            parts = [
                p.format(kind=singular, context=context, query=query)
                .replace("Some", "A")
                .replace("are all", "is")
                .replace(" are", " is")
                for p in PROMPTS["niah"]
            ]
        return tuple(parts), [a for i in asked for a in values[i]]

    def _vt(self, n: int):
        names: list[str] = []
        while len(names) < 5:
            name = "".join(self.rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        value = str(self.rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
        lines = [NOISE] * n
        for offset, at in enumerate(sorted(self.rng.sample(range(n), len(chain)))):
            lines.insert(at + offset, chain[offset])
        context = "\n".join(lines).replace(". \n", ".\n")
        parts = tuple(p.format(context=context, query=value, num_v=len(names)) for p in PROMPTS["vt"])
        return parts, names

    def _word_list(self, n_words: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        chosen = self.rng.sample(self.vocab, min(n_words, len(self.vocab)))
        top, rest = chosen[:10], chosen[10:]
        words = top * common + rest * uncommon
        self.rng.shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), top

    def _cwe(self, n: int):
        shot, shot_answer = self._word_list(*((20, 3, 1) if self.short else (40, 10, 3)))  # RULER's one example
        example = "".join(p.format(context=shot) for p in PROMPTS["cwe"][:2])
        example += " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
        context, answer = self._word_list(n, *((6, 1) if self.short else (30, 3)))
        intro = PROMPTS["cwe"][0].format(context=context)
        return (example + "\n" + intro, PROMPTS["cwe"][1], PROMPTS["cwe"][2]), answer

    def _fwe(self, n: int):
        vocab: set[str] = set()
        while len(vocab) < 80:  # RULER: vocab_size = (max_seq_length - tokens to generate) // 50 at 4k
            vocab.add("".join(self.rng.choices(string.ascii_lowercase, k=6)))
        ranked = sorted(vocab)
        self.rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent is noise
        zeta = sum(k**-2.0 for k in range(1, 100_000))
        words = [w for k, w in enumerate(ranked, 1) for _ in range(int(n * k**-2.0 / zeta))]
        self.rng.shuffle(words)
        parts = tuple(p.format(context=" ".join(words)) for p in PROMPTS["fwe"])
        return parts, ranked[1:4]


for _name, _variant in VARIANTS.items():
    _doc = f"RULER {_name} ({_variant.kind}), built offline from RULER's recipe; string match."
    _attrs = {"variant": _variant, "max_new_tokens": TOKENS_TO_GENERATE[_variant.kind], "__doc__": _doc}
    _cls = dataclass(type(f"Ruler_{_name}", (Ruler,), {**_attrs, "__module__": __name__}))
    globals()[_cls.__name__] = _cls  # importable by name (pickling)
    register_task(f"ruler_{_name}")(_cls)
