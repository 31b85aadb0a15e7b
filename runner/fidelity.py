"""Teacher-forced fidelity to the full cache: how much a method's budget changes the model's
next-token distribution, token by token, over a reference continuation.

A sample is a list of segments ``(token_ids, scored)`` in sequence order: unscored segments (the
prompt, tool observations, later user turns) are *fed* as a session feeds prompts (chunked prefill,
prefill-time eviction); scored segments (the reference answer, the reference agent's turns) are
*teacher-forced*: fed one token at a time exactly as decoding would feed the tokens it generated, so
the method observes them and evicts at every decode step (:meth:`engine.Session.teacher_force`).

The reference is the same model with a full cache: one forward pass over the whole sequence, keeping
only the logits that predict scored tokens. At each scored token t with reference distribution p
(full cache) and q (under the method):

* ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` (nats), computed in float64 from float32 logits;
* ``delta NLL = -log q_t + log p_t`` (positive: the method makes the reference token less likely);
* ``top-1 agreement = [argmax p == argmax q]``.

A sample's figures are their means over its scored tokens. Under method ``full`` the two passes
compute the same function, so KL is float rounding (< 1e-6 per token) and top-1 agreement is 100%.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

import torch

from kvleague.engine import Engine, GenerationResult
from kvleague.engine.contract import EvictionMethod
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol

Segment = tuple[list[int], bool]  # (token ids, scored)


@dataclass
class FidelityResult:
    tokens: int  # scored tokens
    kl_mean: float
    kl_max: float
    delta_nll_mean: float
    top1_agreement: float
    nll_full_mean: float
    nll_method_mean: float
    seconds: float  # the method's teacher-forced pass (the full-cache pass not included)
    reference_seconds: float
    generation: GenerationResult = field(repr=False)
    per_token: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def to_dict(self, per_token: bool = False) -> dict:
        out = asdict(self)
        out.pop("generation")
        if not per_token:
            out.pop("per_token")
        return out


def truncate(segments: Sequence[Segment], max_scored: int | None) -> list[Segment]:
    """The segments up to ``max_scored`` scored tokens (the last scored segment cut; later ones dropped)."""
    out: list[Segment] = []
    left = max_scored
    for ids, scored in segments:
        if scored and left is not None:
            if left <= 0:
                break
            ids = ids[:left]
            left -= len(ids)
        out.append((list(ids), scored))
    return [s for s in out if s[0]]


def prompt_segments(segments: Sequence[Segment]) -> list[Segment]:
    """The unscored segments before the first scored one: the prompt a relative budget
    (``budget_base: prompt``) counts from, and a self-generated trace continues."""
    out: list[Segment] = []
    for ids, scored in segments:
        if scored:
            break
        out.append((list(ids), False))
    return out


def prompt_ids(segments: Sequence[Segment]) -> list[int]:
    """The token ids of :func:`prompt_segments`, in order: what a self-generated trace continues."""
    return [t for ids, _ in prompt_segments(segments) for t in ids]


def prompt_tokens(segments: Sequence[Segment]) -> int:
    """How many tokens :func:`prompt_segments` holds."""
    return len(prompt_ids(segments))


def self_traces(engine: Engine, prompts: Sequence[list[int]], n_tokens: int) -> list[list[int]]:
    """The model's own greedy continuation of each prompt under the full cache, ``n_tokens`` long:
    the reference trace of the paper's regime, where a method evicts among the tokens the model
    generated. End-of-turn and every other special token are banned (``GenerationSettings.suppress``,
    as ``min_new_tokens`` does for EOS), so a model that would stop early keeps reasoning in plain text
    and every trace has the same length; the teacher-forced comparison is over the unbanned
    distribution. Decoded together (``Engine.generate_batch``); each equals its sequence alone."""
    from kvleague.engine.protocol import GenerationSettings
    from kvleague.methods.registry import build_method

    banned = sorted(set(engine.tokenizer.all_special_ids) | set(engine.eos_ids))
    settings = GenerationSettings(max_new_tokens=n_tokens, suppress=tuple(banned))
    longest = max(len(p) for p in prompts) + n_tokens
    results = engine.generate_batch(
        [list(p) for p in prompts], [build_method("full", {}) for _ in prompts], longest, Protocol(), settings
    )
    traces = [r.token_ids for r in results]
    for trace in traces:
        if len(trace) != n_tokens:  # a stop reason other than length: the ban did not hold
            raise AssertionError(f"fidelity: a self-generated trace has {len(trace)} tokens, not {n_tokens}")
    return traces


def self_trace_segments(segments: Sequence[Segment], trace: list[int]) -> list[Segment]:
    """``segments``' prompt (:func:`prompt_segments`), then ``trace`` scored."""
    return [*prompt_segments(segments), (list(trace), True)]


def trace_hash(segments: Sequence[Segment]) -> str:
    """SHA-256 of the scored token ids: every method and budget of a sample must see the same trace."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps([ids for ids, scored in segments if scored]).encode()).hexdigest()


def check_segments(segments: Sequence[Segment]) -> None:
    if not segments or segments[0][1]:
        raise KvleagueError("fidelity: a sample must start with an unscored prompt segment")
    if not any(scored for _, scored in segments):
        raise KvleagueError("fidelity: a sample needs at least one scored token")


@torch.inference_mode()
def full_cache_logprobs(engine: Engine, segments: Sequence[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probabilities [n, V] float64, targets [n])`` of the full cache at the n scored tokens, from
    one forward pass over the whole sequence."""
    ids = [t for seg, _ in segments for t in seg]
    predicting: list[int] = []  # the position whose logits predict each scored token
    targets: list[int] = []
    at = 0
    for seg, scored in segments:
        if scored:
            predicting += range(at - 1, at - 1 + len(seg))
            targets += seg
        at += len(seg)
    return torch.log_softmax(engine.sequence_logits(ids, predicting).double(), dim=-1), torch.tensor(targets)


class _Comparison:
    """Collects one sequence's per-token figures against the full cache's log-probabilities."""

    def __init__(self, reference: tuple[torch.Tensor, torch.Tensor]):
        self.full_lp, self.targets = reference
        self.kl: list[float] = []
        self.dnll: list[float] = []
        self.top1: list[float] = []
        self.nll_full: list[float] = []
        self.nll_method: list[float] = []

    def on_logits(self, logits: torch.Tensor, token: int) -> None:
        p_log = self.full_lp[len(self.kl)]
        q_log = torch.log_softmax(logits.double(), dim=-1)
        self.kl.append(float((p_log.exp() * (p_log - q_log)).sum()))
        self.nll_full.append(-float(p_log[token]))
        self.nll_method.append(-float(q_log[token]))
        self.dnll.append(self.nll_method[-1] - self.nll_full[-1])
        self.top1.append(float(int(p_log.argmax()) == int(q_log.argmax())))

    def result(
        self, seconds: float, reference_seconds: float, generation: GenerationResult, per_token: bool
    ) -> FidelityResult:
        if len(self.kl) != len(self.targets):  # the two passes must have walked the same tokens
            raise AssertionError(
                f"fidelity: {len(self.kl)} scored tokens teacher-forced, {len(self.targets)} in the reference"
            )
        n = len(self.kl)
        return FidelityResult(
            tokens=n,
            kl_mean=sum(self.kl) / n,
            kl_max=max(self.kl),
            delta_nll_mean=sum(self.dnll) / n,
            top1_agreement=sum(self.top1) / n,
            nll_full_mean=sum(self.nll_full) / n,
            nll_method_mean=sum(self.nll_method) / n,
            seconds=seconds,
            reference_seconds=reference_seconds,
            generation=generation,
            per_token={"kl": self.kl, "delta_nll": self.dnll, "top1": self.top1} if per_token else {},
        )


def measure(
    engine: Engine,
    segments: Sequence[Segment],
    method: EvictionMethod,
    budget: int,
    protocol: Protocol | None = None,
    seed: int = 0,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    per_token: bool = False,
) -> FidelityResult:
    """Teacher-force ``segments`` under ``method`` and compare every scored token with the full cache
    (``reference``: :func:`full_cache_logprobs` of the same segments, computed here when not given;
    pass it to reuse one full-cache pass across methods and budgets)."""
    check_segments(segments)
    protocol, budget = (protocol or Protocol()).for_prompt(budget, prompt_tokens(segments))
    start = time.perf_counter()
    comparison = _Comparison(reference if reference is not None else full_cache_logprobs(engine, segments))
    reference_seconds = time.perf_counter() - start if reference is None else 0.0
    start = time.perf_counter()
    with engine.session(method, budget, protocol, seed) as session:
        for ids, scored in segments:
            if scored:
                session.teacher_force(ids, comparison.on_logits)
            else:
                session.feed(ids)
        generation = session.result()
    return comparison.result(time.perf_counter() - start, reference_seconds, generation, per_token)


def single_answer(segments: Sequence[Segment]) -> bool:
    """Whether the scored tokens are one final segment after the unscored ones (a prompt and its
    answer), the shape :func:`measure_batch` forces together; multi-turn samples alternate."""
    return bool(segments) and segments[-1][1] and not any(scored for _, scored in segments[:-1])


def measure_batch(
    engine: Engine,
    samples: Sequence[Sequence[Segment]],
    methods: Sequence[EvictionMethod],
    budgets: Sequence[int],
    protocol: Protocol | None = None,
    seeds: Sequence[int] | None = None,
    references: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    batch_size: int | None = None,
    per_token: bool = False,
) -> list[FidelityResult]:
    """``measure(engine, samples[i], methods[i], budgets[i], protocol, seeds[i], references[i])`` for
    every i, the answers teacher-forced ``batch_size`` sequences at a time
    (:func:`engine.batch.teacher_force_batch`; ``None``: what fits in memory). Each sequence is
    fed its prompt alone, as at batch 1, and sees the logits it would see alone, up to float rounding
    of the batched kernels. Multi-turn samples (scored turns between unscored observations) run at
    batch 1: their later segments are fed after earlier teacher-forced ones, per sequence.

    ``seconds`` of a batched result: its own prompt feed plus the batch's teacher-forced wall time
    split evenly over its sequences (their throughput, not the latency one sequence saw)."""
    from kvleague.engine.batch import auto_batch_size, check_batch_arguments, teacher_force_batch
    from kvleague.engine.session import Session

    n = len(samples)
    if not (len(methods) == len(budgets) == n):
        raise KvleagueError(
            f"fidelity: {n} samples, {len(methods)} methods and {len(budgets)} budgets; give one of each per sequence"
        )
    check_batch_arguments(methods, batch_size)
    protocol = protocol or Protocol()
    # each sequence's own protocol and budget (a relative budget counts from its own prompt)
    resolved = [protocol.for_prompt(budgets[i], prompt_tokens(samples[i])) for i in range(n)]
    seeds = [0] * n if seeds is None else list(seeds)
    results: list[FidelityResult | None] = [None] * n
    comparisons: dict[int, _Comparison] = {}
    reference_seconds = [0.0] * n
    batched: list[int] = []
    for i, segments in enumerate(samples):
        check_segments(segments)
        start = time.perf_counter()
        reference = references[i] if references is not None else full_cache_logprobs(engine, segments)
        reference_seconds[i] = 0.0 if references is not None else time.perf_counter() - start
        if single_answer(segments):
            comparisons[i] = _Comparison(reference)
            batched.append(i)
        else:
            result = measure(engine, segments, methods[i], budgets[i], protocol, seeds[i], reference, per_token)
            result.reference_seconds = reference_seconds[i]
            results[i] = result
    size = batch_size or auto_batch_size(
        engine,
        [sum(len(ids) for ids, _ in samples[i]) for i in batched],
        max((len(samples[i][-1][0]) for i in batched), default=1),
        max((resolved[i][1] for i in batched), default=1),
        protocol,
        never_evicts=all(methods[i].never_evicts for i in batched),
    )
    for at in range(0, len(batched), size):
        chunk = batched[at : at + size]
        sessions = [Session(engine, methods[i], resolved[i][1], resolved[i][0], seeds[i]) for i in chunk]
        fed = []
        for session, i in zip(sessions, chunk):
            start = time.perf_counter()
            with session:
                for ids, _ in samples[i][:-1]:
                    session.feed(ids)
            fed.append(time.perf_counter() - start)
        start = time.perf_counter()
        teacher_force_batch(
            engine, sessions, [samples[i][-1][0] for i in chunk], [comparisons[i].on_logits for i in chunk]
        )
        share = (time.perf_counter() - start) / len(chunk)
        for session, i, feed_seconds in zip(sessions, chunk, fed):
            results[i] = comparisons[i].result(feed_seconds + share, reference_seconds[i], session.result(), per_token)
    assert all(r is not None for r in results)  # every sample was measured alone or in a batch
    return cast("list[FidelityResult]", results)
