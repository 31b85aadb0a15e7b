"""Teacher-forced fidelity to the full cache: how much a method's budget changes the model's
next-token distribution, token by token, over a reference continuation.

A sample is a list of segments ``(token_ids, scored)`` in sequence order: unscored segments (the
prompt, tool observations, later user turns) are *fed* as a session feeds prompts (chunked prefill,
prefill-time eviction); scored segments (the reference answer, the reference agent's turns) are
*teacher-forced*: fed one token at a time exactly as decoding would feed the tokens it generated, so
the method observes them and evicts at every decode step (:meth:`runner.engine.Session.teacher_force`).

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
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from runner.engine.contract import EvictionMethod
from runner.engine import Engine, GenerationResult
from runner.engine.errors import KvleagueError
from runner.engine.protocol import Protocol

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
    model = engine.model
    out = model(input_ids=torch.tensor([ids], device=engine.device), use_cache=False,
                logits_to_keep=torch.tensor(predicting, device=engine.device))
    return torch.log_softmax(out.logits[0].double(), dim=-1), torch.tensor(targets)


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
    start = time.perf_counter()
    full_lp, targets = reference if reference is not None else full_cache_logprobs(engine, segments)
    reference_seconds = time.perf_counter() - start if reference is None else 0.0
    kl, dnll, top1, nll_full, nll_method = [], [], [], [], []
    step = 0

    def on_logits(logits: torch.Tensor, token: int) -> None:
        nonlocal step
        p_log = full_lp[step]
        q_log = torch.log_softmax(logits.double(), dim=-1)
        kl.append(float((p_log.exp() * (p_log - q_log)).sum()))
        nll_full.append(-float(p_log[token]))
        nll_method.append(-float(q_log[token]))
        dnll.append(nll_method[-1] - nll_full[-1])
        top1.append(float(int(p_log.argmax()) == int(q_log.argmax())))
        step += 1

    start = time.perf_counter()
    with engine.session(method, budget, protocol or Protocol(), seed) as session:
        for ids, scored in segments:
            if scored:
                session.teacher_force(ids, on_logits)
            else:
                session.feed(ids)
        generation = session.result()
    seconds = time.perf_counter() - start
    if step != len(targets):  # the two passes must have walked the same tokens
        raise AssertionError(f"fidelity: {step} scored tokens teacher-forced, {len(targets)} in the reference")
    n = len(kl)
    return FidelityResult(
        tokens=n, kl_mean=sum(kl) / n, kl_max=max(kl), delta_nll_mean=sum(dnll) / n, top1_agreement=sum(top1) / n,
        nll_full_mean=sum(nll_full) / n, nll_method_mean=sum(nll_method) / n, seconds=seconds,
        reference_seconds=reference_seconds, generation=generation,
        per_token={"kl": kl, "delta_nll": dnll, "top1": top1} if per_token else {},
    )
