"""The contract between the runner and an evaluation task.

A task is a dataclass subclass of :class:`Task`, registered with
``@register_task("name")`` (see :mod:`tasks.registry`):

* its **dataclass fields are its options** (typed, with defaults, e.g. ``context_length`` for
  ``niah``); everything else is a class attribute:

  - ``name``            registry name (set by the decorator)
  - ``domain``          one of ``"math" | "code" | "agentic" | "longqa"``
  - ``source``          a :class:`DataSource`: Hub id + revision (what users with internet get) and
                        the local layout under the data directory (what offline runs and CI read)
  - ``scorer_version``  bump whenever scoring changes; stored with every per-sample result
  - ``size``            documented number of samples (``kvleague tasks`` shows it without loading)
  - ``metric``          name of the headline key in :meth:`Task.aggregate`'s output
  - ``stop``            default stop strings (a tuple of str)
  - ``max_new_tokens``  default generation length
  - ``protect_prompt``  whether the engine should protect the prompt from eviction (``False`` for
                        long-context tasks, whose context *is* the prompt: prefill compression)
  - ``system_prompt``   optional system message put in front of string prompts

* :meth:`Task.load_records` (implemented by every task) returns all samples of the task in
  dataset order; :meth:`Task.load` adds deterministic sub-sampling on top of it;
* :meth:`Task.bind_tokenizer` hands the model's tokenizer to tasks whose data depends on it (``niah``);
* :meth:`Task.build_prompt` turns a sample into token ids with the tokenizer's chat template when
  it has one (plain text otherwise);
* :meth:`Task.split_prompt` cuts the prompt into the context and the question kvpress's pipeline feeds
  apart (``scope: context``): a sample's ``metadata`` ``context`` / ``question`` / ``answer_prefix``
  where it has them, else the whole user message as the context;
* :meth:`Task.score` (implemented by every task) scores one completion and returns a
  :class:`ScoreResult`; :meth:`Task.score_many` scores a batch (parallel where it pays);
  :meth:`Task.aggregate` reduces many results to per-task metrics.

Data directory resolution (:func:`tasks.data.resolve_data_dir`): the explicit ``data_dir``
argument, else ``$KVLEAGUE_DATA_DIR``, else none (the Hugging Face Hub). :class:`DataSource` lives in
:mod:`tasks.data` (re-exported here); ``base`` imports ``data``, never the reverse.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from kvleague.engine.errors import KvleagueError
from kvleague.tasks.data import DataSource, resolve_data_dir

__all__ = ["DOMAINS", "DataSource", "Domain", "Sample", "ScoreResult", "Task"]

#: the domains, in display order: a new domain is one edit here (the sweep config's ``protocol_by_domain``
#: keys and the task registry's check read them)
Domain = Literal["math", "code", "agentic", "longqa"]
DOMAINS: tuple[Domain, ...] = get_args(Domain)


@dataclass
class Sample:
    """One evaluation item.

    ``sample_id`` is stable across runs and machines (the dataset's own id where it has one).
    ``prompt`` is either the user message (str) or a full chat (list of ``{"role", "content"}``).
    ``reference`` is the gold answer in whatever form the task's scorer expects.
    """

    sample_id: str
    task: str
    prompt: str | list[dict[str, Any]]
    reference: Any
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScoreResult:
    """The verdict on one completion.

    ``correct`` is the binary verdict (F1 tasks set it to normalized exact match), ``score`` in
    [0, 1] is the task's per-sample metric (1/0 for accuracy tasks, F1 for F1 tasks), ``extracted``
    the answer pulled out of the completion (``None`` when nothing could be extracted), ``details``
    anything else worth storing. ``sample_id`` lets
    :meth:`Task.aggregate` group several completions of one sample (pass@k); scorers fill it in.
    """

    correct: bool
    score: float
    extracted: str | None
    details: dict[str, Any] = field(default_factory=dict)
    sample_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Task:
    """Base class of every task. Subclasses are dataclasses; their fields are task options."""

    name: ClassVar[str] = ""
    domain: ClassVar[Domain]
    source: ClassVar[DataSource]
    scorer_version: ClassVar[str] = "1"
    size: ClassVar[int | None] = None
    metric: ClassVar[str] = "accuracy"
    stop: ClassVar[tuple[str, ...]] = ()
    max_new_tokens: ClassVar[int] = 1024
    protect_prompt: ClassVar[bool] = True
    system_prompt: ClassVar[str | None] = None

    # ---- options -------------------------------------------------------------------------------
    @classmethod
    def options(cls) -> tuple[dataclasses.Field, ...]:
        """The task's options (its dataclass fields)."""
        return dataclasses.fields(cls)

    def option_values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in self.options()}

    # ---- data ----------------------------------------------------------------------------------
    def load_records(self, data_dir: Path | None) -> list[Sample]:
        """All samples in dataset order. ``data_dir`` is already resolved (``None``: use the Hub).

        Implemented by every task; must be deterministic for given options.
        """
        raise NotImplementedError

    def load(self, limit: int | None = None, seed: int = 0, data_dir: str | Path | None = None) -> list[Sample]:
        """Samples of this task, deterministic for ``(options, limit, seed)``.

        Without ``limit`` (or with ``limit >= size``) every sample in dataset order; with a smaller
        ``limit`` a uniform random subset drawn with ``random.Random(seed)``, sorted by ``sample_id``.
        Subsets of different limits are not always nested: ``random.sample`` switches algorithm with
        the ratio of ``limit`` to size (on HumanEval's 164 items the subset of 20 is not inside the
        subset of 30), so a sweep raised from one limit to another may run a few samples beside the
        earlier ones. Kept so, because every stored result's sample set depends on it.
        """
        samples = self.load_records(resolve_data_dir(data_dir))
        if limit is not None and limit < 0:
            raise KvleagueError(f"limit: must be >= 0 or None, got {limit}")
        if limit is None or limit >= len(samples):
            return samples
        chosen = random.Random(seed).sample(range(len(samples)), limit)
        return sorted((samples[i] for i in chosen), key=lambda s: s.sample_id)

    #: True when the samples depend on the model's tokenizer (lengths counted in its tokens): the
    #: runner then calls :meth:`bind_tokenizer` before :meth:`load`, once per model.
    tokenizer_dependent: ClassVar[bool] = False

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Called by the runner with the model's tokenizer before :meth:`load`. Tasks whose samples
        depend on the tokenizer (``niah`` measures its context in tokens) keep it; others ignore it."""

    # ---- prompting -----------------------------------------------------------------------------
    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        """The chat messages for ``sample`` (a string prompt becomes one user message)."""
        if isinstance(sample.prompt, str):
            msgs: list[dict[str, Any]] = []
            if self.system_prompt:
                msgs.append({"role": "system", "content": self.system_prompt})
            msgs.append({"role": "user", "content": sample.prompt})
            return msgs
        return [dict(m) for m in sample.prompt]

    def prompt_text(self, sample: Sample) -> str:
        """Plain-text prompt used when the tokenizer has no chat template."""
        if isinstance(sample.prompt, str):
            return f"{self.system_prompt}\n\n{sample.prompt}" if self.system_prompt else sample.prompt
        return "\n\n".join(str(m.get("content", "")) for m in sample.prompt)

    def build_prompt(self, sample: Sample, tokenizer: Any) -> list[int]:
        """Token ids of the prompt: chat template + generation prompt when the tokenizer has one,
        else the plain text encoded with the tokenizer's default special tokens."""
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(self.messages(sample), add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if hasattr(out, "keys") else out
            if ids and isinstance(ids[0], list):  # batched form
                ids = ids[0]
            return [int(i) for i in ids]
        return [int(i) for i in tokenizer(self.prompt_text(sample))["input_ids"]]

    def split_prompt(self, sample: Sample, tokenizer: Any, query_aware: bool = False) -> tuple[list[int], list[int]]:
        """``(context ids, question ids)`` as kvpress's ``KVPressTextGenerationPipeline`` builds them: the
        chat template around the context, cut where the user message ends; the question, then the
        template's suffix (end of turn, assistant header) and the answer prefix. Without a chat
        template the context follows the BOS token and the question ends with a newline. ``query_aware``:
        the question joins the context (kvpress's ``query_aware`` evaluation). A sample without
        ``metadata["context"]`` is all context (its question empty)."""
        meta = sample.metadata
        context = meta["context"] if "context" in meta else self.prompt_text(sample)
        question = meta.get("question", "")
        if query_aware:
            context, question = context + question, ""
        if getattr(tokenizer, "chat_template", None):
            separator = "#" * (len(context) + 10)  # text no template writes: where the message ends
            messages = [m for m in self.messages(sample) if m["role"] == "system"]
            text = tokenizer.apply_chat_template(
                [*messages, {"role": "user", "content": context + separator}],
                add_generation_prompt=True,
                tokenize=False,
            )
            context, suffix = text.split(separator)
        else:
            context, suffix = (tokenizer.bos_token or "") + context, "\n"
        question = question + suffix + meta.get("answer_prefix", "")

        def encode(text: str) -> list[int]:
            return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]

        return encode(context), encode(question)

    # ---- reference continuation (teacher-forced fidelity) -----------------------------------------
    def reference_continuation(self, sample: Sample) -> str | None:
        """The task's own reference answer, written as the model's reply (a worked solution, the gold
        code, the gold answer); ``None`` when the sample has none. Tasks with references override it."""
        return None

    @classmethod
    def has_reference(cls) -> bool:
        """Whether the task can be measured by teacher-forced fidelity (checked when a sweep is validated)."""
        return (
            cls.reference_continuation is not Task.reference_continuation
            or cls.fidelity_segments is not Task.fidelity_segments
        )

    def fidelity_segments(self, sample: Sample, tokenizer: Any) -> list[tuple[list[int], bool]]:
        """``[(prompt ids, False), (reference reply ids + EOS, True)]``: the prompt exactly as for
        generation, then the reply to teacher-force (see ``runner/fidelity.py``)."""
        text = self.reference_continuation(sample)
        if not text:
            raise KvleagueError(f"task {self.name}: sample {sample.sample_id} has no reference continuation")
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if tokenizer.eos_token_id is not None:  # the reply ends the turn, as the model's would
            ids.append(int(tokenizer.eos_token_id))
        return [(self.build_prompt(sample, tokenizer), False), (ids, True)]

    # ---- scoring -------------------------------------------------------------------------------
    def score(self, sample: Sample, completion: str) -> ScoreResult:
        """Score one completion of ``sample``. Implemented by every task."""
        raise NotImplementedError

    def score_many(self, pairs: Sequence[tuple[Sample, str]]) -> list[ScoreResult]:
        """Score many ``(sample, completion)`` pairs, in order. Tasks whose scoring is slow (code
        execution) override this to work in parallel; the results equal ``score`` one by one."""
        return [self.score(sample, completion) for sample, completion in pairs]

    def aggregate(self, results: Sequence[ScoreResult]) -> dict[str, Any]:
        """Per-task metrics: ``n`` (completions), ``n_samples`` (distinct sample ids), ``accuracy``
        (mean of ``correct``) and ``score`` (mean of ``score``). Subclasses add their own keys
        (``pass@1``, ``f1``...); ``metric`` names the headline key."""
        n = len(results)
        ids = {r.sample_id or f"#{i}" for i, r in enumerate(results)}
        return {
            "n": n,
            "n_samples": len(ids),
            "accuracy": (sum(bool(r.correct) for r in results) / n) if n else 0.0,
            "score": (sum(float(r.score) for r in results) / n) if n else 0.0,
        }

    # ---- description ---------------------------------------------------------------------------
    @classmethod
    def describe(cls) -> dict[str, Any]:
        """JSON-ready description (used by ``kvleague tasks --json``)."""
        import typing

        hints = typing.get_type_hints(cls)
        opts = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            tp = hints.get(f.name)
            opt = {"name": f.name, "type": getattr(tp, "__name__", str(tp)), "default": default}
            if "unit" in f.metadata:  # e.g. niah's context_length: tokens of the bound tokenizer
                opt["unit"] = f.metadata["unit"]
            opts.append(opt)
        doc = (cls.__doc__ or "").strip().splitlines()
        return {
            "name": cls.name,
            "domain": cls.domain,
            "size": cls.size,
            "metric": cls.metric,
            "scorer_version": cls.scorer_version,
            "summary": doc[0] if doc and not doc[0].startswith(cls.__name__ + "(") else "",
            "source": cls.source.describe(),
            "options": opts,
            "class": f"{cls.__module__}:{cls.__qualname__}",
        }
