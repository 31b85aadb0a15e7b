"""Per-token importance signals and counterfactual importance labels of one sample (issue 21).

**The sequence.** A sample's fidelity segments (``Task.fidelity_segments``, cut to ``max_tokens``
scored tokens as ``kvleague fidelity`` does) are split into the *context* (every segment before the
last scored one: the prompt, and in agent episodes earlier turns and observations) and the *answer*
(the last scored segment: the task's reference continuation, or with ``trace="greedy"`` the model's
own greedy continuation of the context, ``max_tokens`` tokens at most). With ``trace="self"`` the
context is the sample's prompt (the unscored segments before its first scored one, as fidelity's
``reference: self`` takes it) and the answer the model's own greedy full-cache trace of exactly
``max_tokens`` tokens, special tokens suppressed (``runner.fidelity.self_traces``).

**Where the windows slide** (``occluded``): over the *context* (the default, below), or over the
*trace* (``occluded="trace"``, the EpiKV authors' setting: the prompt is never occluded, being
important by definition). Over the trace, windows start every ``stride`` tokens from the first trace
token while at least one trace token follows the window; a window's label is the increase of the
mean NLL of the trace tokens *after* it (its own tokens are occluded, so they are not scored), and
the studied tokens are the trace tokens the windows cover. The ``position`` control is then the
token's index in the trace. The answer-flip label is not defined there.

**Occlusion** (the EpiKV authors' ``scripts/label_importance.py``): windows of ``window`` tokens start
every ``stride`` tokens from the first context token while the start is inside the context; the last
ones are cut at the answer (never occluded, as the authors never occlude the answer section). A
window's tokens are *replaced* by one filler id (the tokenizer's pad id, else its EOS id: the authors'
default ``eos`` filler, ``pad_token_id or eos_token_id``), so every position keeps its place and only
the window's content changes. Unlike the authors, the windows cover the prompt too: here the context
is what the answer depends on, and the cache holds it.

* ``occlusion_nll`` (every sample): the increase of the answer's mean per-token NLL (nats) when the
  window is occluded, teacher-forcing the answer after the occluded context;
* ``answer_flip`` (only samples whose full-context greedy answer the task scores correct, as the
  authors keep only correct traces): 1 when the greedy answer regenerated after the occluded context
  (``flip_tokens`` tokens at most, cut at the task's stop strings) is no longer correct.

Token labels: a token takes the largest label of the windows covering it (the authors' OR over
overlapping windows for the binary label; the maximum for the continuous one).

**Signals** (one eager forward pass over context + answer; ``l`` is the decoder layer):

* ``hs_l2_diff_l{l}``: ``||h_t - h_{t-1}||`` of layer ``l``'s output (HF ``hidden_states[l + 1]``, as
  the authors index it; 0 at t = 0); ``hs_l2_diff_rolling64_l{l}``: its mean over the trailing
  ``rolling`` tokens (fewer at the start), the paper's smoothed signal;
* ``key_norm_l{l}``, ``key_var_l{l}``, ``value_norm_l{l}``, ``value_var_l{l}``: L2 norm and variance
  (over head_dim, unbiased as ``torch.var``) of the cached post-RoPE key / value, mean over KV heads;
* ``h2o_l{l}``: attention the token receives, summed over every query of the sequence (H2O's
  cumulative attention), mean over heads; ``attn_entropy_l{l}``: entropy of the token's own attention
  row (``-sum a log a``, a clamped at 1e-10 as the authors do), mean over heads;
* ``{family}_mean``: the mean over layers of each family but the hidden-state ones (the authors'
  all-layer signals);
* ``position``: the token's index, a control: labels and smoothed signals both drift with position
  (on a context shorter than the rolling window, the rolling mean is a running mean from the first
  token), so a signal is informative only as far as it beats position; the command also reports each
  headline signal's rank partial rho with position held fixed (``runner.signals.correlation``);
* ``method:{name}``: every registered method's own ``score`` through the method contract: the context
  is fed as a prompt and the answer teacher-forced (so decode-time state is built as in a run), with a
  budget above the sequence length (no eviction), then ``score`` is called once on the whole cache at
  the end of the trace with ``CacheView.budget`` = ``score_budget_fraction`` of the cache and the
  session seed ``seed + crc32(sample_id)`` (a seed per sample). ``[L, T]`` and ``[L, H, T]`` scores
  are averaged over layers and heads; ``-inf`` ("must drop") counts as below every finite score,
  ``+inf`` ("always keep") above. Methods that never evict prompt tokens score
  every prompt token ``+inf``: on a context that is all prompt their signal is constant and rho is
  undefined (stored as null), which says that the method does not rank those tokens at all.

Every signal and label is reported for the occluded tokens only: the context tokens (the answer is never
occluded), or under ``occluded="trace"`` the trace tokens the windows cover.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvleague.engine import Engine
from kvleague.engine.backend import Analysis, Prefix
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol
from kvleague.runner.fidelity import Segment, prompt_ids, self_traces, truncate
from kvleague.runner.reference_tasks import OCCLUDED, TRACES
from kvleague.runner.signals.method_panel import MethodPanel

#: per-layer signal families, in display order
LAYER_FAMILIES = (
    "hs_l2_diff_rolling64",
    "hs_l2_diff",
    "key_norm",
    "key_var",
    "value_norm",
    "value_var",
    "h2o",
    "attn_entropy",
)
#: families that also get an all-layer mean (the authors' kv and attention signals are all-layer means)
MEAN_FAMILIES = ("key_norm", "key_var", "value_norm", "value_var", "h2o", "attn_entropy")
LABELS = ("occlusion_nll", "answer_flip")


@dataclass(frozen=True)
class SignalOptions:
    window: int = 32
    stride: int = 16
    rolling: int = 64
    max_tokens: int = 64
    trace: str = "reference"
    occluded: str = "context"
    flip_label: bool = False
    flip_tokens: int = 64
    score_budget_fraction: float = 0.5
    seed: int = 0

    def check(self) -> None:
        for name in ("window", "stride", "rolling", "max_tokens", "flip_tokens"):
            if getattr(self, name) < 1:
                raise KvleagueError(f"{name.replace('_', '-')}: must be a positive integer, got {getattr(self, name)}")
        if self.trace not in TRACES:
            raise KvleagueError(f"trace: unknown {self.trace!r}; allowed: {', '.join(TRACES)}")
        if self.occluded not in OCCLUDED:
            raise KvleagueError(f"occlude: unknown {self.occluded!r}; allowed: {', '.join(OCCLUDED)}")
        if self.occluded == "trace" and self.flip_label:
            raise KvleagueError("flip-label: the answer-flip label needs windows over the context (--occlude context)")
        if self.occluded == "trace" and self.max_tokens <= self.window:
            raise KvleagueError(
                f"max-tokens: windows over the trace need a trace longer than a window ({self.window}), "
                f"got {self.max_tokens}"
            )
        if not 0.0 < self.score_budget_fraction <= 1.0:
            raise KvleagueError(f"score-budget-fraction: must be in (0, 1], got {self.score_budget_fraction}")


@dataclass
class SampleSignals:
    sample_id: str
    context_tokens: int
    answer_tokens: int
    windows: list[tuple[int, int]]
    answer_nll: float  # mean per-token NLL of the answer with the full context
    window_delta_nll: list[float]
    #: the full-context greedy answer is correct (None: the flip label was not asked for)
    full_correct: bool | None
    window_flips: list[int] | None
    labels: dict[str, np.ndarray]  # label name -> [context_tokens]
    signals: dict[str, np.ndarray]  # signal name -> [context_tokens]
    method_errors: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    #: where the windows slid ("context" or "trace"); ``windows`` are absolute indices in context + answer
    occluded: str = "context"
    #: the absolute index of the first studied token (0 over the context; the context's length over the trace)
    span_start: int = 0
    #: the answer's token ids (kept for ``trace="self"``, whose answer is the model's own)
    answer: list[int] | None = None

    @property
    def studied_tokens(self) -> int:
        """How many tokens the labels and signals cover (the context, or the trace tokens under windows)."""
        return len(next(iter(self.labels.values())))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "sample_id": self.sample_id,
            "context_tokens": self.context_tokens,
            "answer_tokens": self.answer_tokens,
            "windows": self.windows,
            "answer_nll": self.answer_nll,
            "window_delta_nll": self.window_delta_nll,
            "full_correct": self.full_correct,
            "window_flips": self.window_flips,
            "method_errors": self.method_errors,
            "seconds": self.seconds,
        }
        if self.occluded != "context":
            out.update(occluded=self.occluded, span_start=self.span_start, studied_tokens=self.studied_tokens)
        if self.answer is not None:
            out["answer_ids"] = self.answer
        return out


def split_context_answer(segments: list[Segment], max_tokens: int) -> tuple[list[int], list[int]]:
    """(context ids, answer ids): the answer is the last scored segment after cutting to ``max_tokens``
    scored tokens; the context is everything before it."""
    segments = truncate(segments, max_tokens)
    last = max((i for i, (_, scored) in enumerate(segments) if scored), default=None)
    if last is None or last == 0:
        raise KvleagueError("signals: a sample needs a context segment and a scored answer segment")
    return [t for ids, _ in segments[:last] for t in ids], list(segments[last][0])


def occlusion_windows(context_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every window: starts every ``stride`` tokens inside the context, cut at its end."""
    return [(s, min(s + window, context_tokens)) for s in range(0, context_tokens, stride)]


def trace_windows(context_tokens: int, trace_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """``[start, end)`` (absolute) of every window over a trace that follows ``context_tokens`` tokens:
    starts every ``stride`` tokens from the trace's first token, cut at its end, kept while at least one
    trace token follows the window (the tokens a window's label is scored on)."""
    end = context_tokens + trace_tokens
    out = [(s, min(s + window, end)) for s in range(context_tokens, end, stride)]
    return [(s, e) for s, e in out if e < end]


def filler_token(tokenizer) -> int:
    token = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise KvleagueError("signals: the tokenizer has neither a pad nor an EOS token to occlude with")
    return int(token)


def token_labels(context_tokens: int, windows: list[tuple[int, int]], window_labels: list[float]) -> np.ndarray:
    """Each token's largest label over the windows covering it (every context token is covered)."""
    out = np.full(context_tokens, -np.inf)
    for (start, end), label in zip(windows, window_labels):
        out[start:end] = np.maximum(out[start:end], label)
    return out


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the trailing ``window`` values at each position (fewer at the start)."""
    csum = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


# -- the model passes ------------------------------------------------------------------------------


def _answer_nll(logits: torch.Tensor, answer: list[int]) -> float:
    """Mean NLL of ``answer`` from the last ``len(answer) + 1`` positions' logits (the last one unused)."""
    return float(_token_nll(logits, answer).mean())


def _token_nll(logits: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """Per-token NLL ``[len(answer)]`` (float64) of ``answer`` from the first ``len(answer)`` rows of ``logits``."""
    logp = torch.log_softmax(logits[: len(answer)].double(), dim=-1)
    return -logp[torch.arange(len(answer)), torch.tensor(answer)]


@torch.inference_mode()
def _greedy(engine: Engine, prefix: Prefix, start: int, context: list[int], max_new: int) -> list[int]:
    """Greedy tokens after ``context`` (fed from ``start`` over the cached ``prefix``), EOS excluded."""
    logits, continued = prefix.continue_with(start, context, 1)
    logits = logits[-1]
    tokens: list[int] = []
    while len(tokens) < max_new:
        token = int(logits.argmax())
        if token in engine.eos_ids:
            break
        tokens.append(token)
        logits = continued.step(token)
    return tokens


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


# -- signals -----------------------------------------------------------------------------------


def model_signals(analysis: Analysis, rolling: int) -> dict[str, np.ndarray]:
    """The per-token signals of every layer (see the module docstring), over the whole sequence."""
    signals: dict[str, np.ndarray] = {}
    per_family: dict[str, list[np.ndarray]] = {f: [] for f in MEAN_FAMILIES}
    n_layers = len(analysis.attentions)
    for layer in range(n_layers):
        h = analysis.hidden_states[layer + 1].double()
        diff = np.zeros(h.shape[0])
        diff[1:] = (h[1:] - h[:-1]).norm(dim=-1).numpy()
        signals[f"hs_l2_diff_l{layer}"] = diff
        signals[f"hs_l2_diff_rolling64_l{layer}"] = rolling_mean(diff, rolling)
        keys = analysis.keys[layer].double()  # [H, T, d]
        values = analysis.values[layer].double()
        attn = analysis.attentions[layer].double()  # [H_q, T, T]
        row = attn.clamp(min=1e-10)
        layer_signals = {
            "key_norm": keys.norm(dim=-1).mean(0),
            "key_var": keys.var(dim=-1).mean(0),
            "value_norm": values.norm(dim=-1).mean(0),
            "value_var": values.var(dim=-1).mean(0),
            "h2o": attn.sum(dim=1).mean(0),
            "attn_entropy": -(row * row.log()).sum(dim=-1).mean(0),
        }
        for family, value in layer_signals.items():
            signals[f"{family}_l{layer}"] = value.numpy()
            per_family[family].append(value.numpy())
    for family, values in per_family.items():
        signals[f"{family}_mean"] = np.mean(values, axis=0)
    signals["position"] = np.arange(len(signals["h2o_mean"]), dtype=np.float64)
    return signals


def method_scores(
    engine: Engine, methods: dict, context: list[int], answer: list[int], fraction: float, seed: int
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Each method's score of every position, read once at the end of the trace on the full cache."""
    panel = MethodPanel(members=methods)
    budget = len(context) + len(answer) + 1  # above the sequence: the engine never evicts
    errors: dict[str, str] = {}
    scores: dict[str, np.ndarray] = {}
    with engine.session(panel, budget, Protocol(), seed) as session:
        session.feed(context)
        session.teacher_force(answer, lambda logits, token: None)
        view = session.cache.view(max(1, int(fraction * session.cache.length)), "decode", session.next_position - 1)
        positions = view.token_positions.cpu().numpy()
        for name, method in methods.items():
            try:
                raw = method.score(view).detach().double().cpu()
            except Exception as exc:  # a method that cannot score here is reported, not fatal to the study
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                continue
            scores[name] = _per_position(raw, positions, view)
    return scores, errors


def _per_position(raw: torch.Tensor, positions: np.ndarray, view) -> np.ndarray:
    """A ``[T]``, ``[L, T]`` or ``[L, H, T]`` score as one value per absolute position (mean over layers
    and heads; first ``-inf`` is set just below the smallest finite score and ``+inf``, "always keep",
    just above the largest, so both keep their rank)."""
    finite = raw[torch.isfinite(raw)]
    low, high = (float(finite.min()) - 1.0, float(finite.max()) + 1.0) if finite.numel() else (0.0, 0.0)
    raw = torch.where(torch.isneginf(raw), torch.full_like(raw, low), raw)
    raw = torch.where(torch.isposinf(raw), torch.full_like(raw, high), raw)
    if raw.dim() == 1:
        per_slot = raw.numpy()
    else:  # every layer and head holds the same positions in the same order (nothing was evicted)
        if not all(bool((p == view.positions[0][0]).all()) for p in view.positions):
            raise AssertionError("signals: slots differ between layers although nothing was evicted")
        per_slot = raw.reshape(-1, raw.shape[-1]).mean(0).numpy()
    out = np.full(int(positions.max()) + 1, np.nan)
    out[positions] = per_slot
    return out


# -- one sample --------------------------------------------------------------------------------


def study_sample(
    engine: Engine, task, sample, methods: dict, options: SignalOptions, trace: list[int] | None = None
) -> SampleSignals:
    """Labels and signals of one sample (see the module docstring). ``trace``: the sample's self trace
    when the caller generated it already (``self_traces`` decodes many prompts together); under
    ``trace="self"`` it is generated here otherwise."""
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    segments = task.fidelity_segments(sample, engine.tokenizer)
    if options.trace == "self":
        context = prompt_ids(segments)
        answer = list(trace) if trace is not None else self_traces(engine, [context], options.max_tokens)[0]
        if len(answer) != options.max_tokens:
            raise KvleagueError(
                f"signals: sample {sample.sample_id}: a self trace of {len(answer)} tokens, "
                f"not --max-tokens {options.max_tokens}"
            )
    else:
        context, answer = split_context_answer(segments, options.max_tokens)
    if options.trace == "greedy":
        answer = _greedy(engine, engine.backend.empty_prefix(), 0, context, options.max_tokens)
        if not answer:
            raise KvleagueError(f"signals: sample {sample.sample_id}: the greedy trace is empty (EOS first)")
    seconds["trace"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = context + answer
    n = len(context)
    over_trace = options.occluded == "trace"
    if over_trace:
        windows = trace_windows(n, len(answer), options.window, options.stride)
        lo, hi = n, windows[-1][1]  # the studied tokens: the trace tokens the windows cover
    else:
        windows = occlusion_windows(n, options.window, options.stride)
        lo, hi = 0, n
    with torch.inference_mode():
        analysis = engine.backend.analysis_pass(ids, len(answer) + 1)
    base_token_nll = _token_nll(analysis.logits, answer)
    base_nll = float(base_token_nll.mean())
    signals = {name: values[lo:hi] for name, values in model_signals(analysis, options.rolling).items()}
    if over_trace:
        signals["position"] = np.arange(hi - lo, dtype=np.float64)  # the index in the trace
    cache = analysis.prefix  # the whole sequence's cache: occlusions and regenerations start from its prefixes
    del analysis
    seconds["signals"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    fill = filler_token(engine.tokenizer)
    delta: list[float] = []
    for start, end in windows:
        occluded = ids[:start] + [fill] * (end - start) + ids[end:]
        if over_trace:  # the trace tokens after the window, against the same tokens unoccluded
            later = ids[end:]
            with torch.inference_mode():
                logits, _ = cache.continue_with(start, occluded, len(later) + 1)
            delta.append(float(_token_nll(logits, later).mean() - base_token_nll[end - n :].mean()))
            continue
        with torch.inference_mode():
            logits, _ = cache.continue_with(start, occluded, len(answer) + 1)
        delta.append(_answer_nll(logits, answer) - base_nll)
    labels = {"occlusion_nll": token_labels(hi - lo, [(s - lo, e - lo) for s, e in windows], delta)}
    seconds["occlusion_nll"] = time.perf_counter() - t0

    full_correct = flips = None
    if options.flip_label:
        t0 = time.perf_counter()
        full_correct = _answer_correct(engine, task, sample, cache, n - 1, context, options)
        if full_correct:
            flips = []
            for start, end in windows:
                occluded = context[:start] + [fill] * (end - start) + context[end:]
                flips.append(int(not _answer_correct(engine, task, sample, cache, start, occluded, options)))
            labels["answer_flip"] = token_labels(n, windows, flips)
        seconds["answer_flip"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # a seed of its own per sample: one seed for all would make a randomised method (``random``) the same
    # fixed function of position in every sample, which correlates with position-dependent labels
    seed = options.seed + zlib.crc32(str(sample.sample_id).encode())
    scores, errors = method_scores(engine, methods, context, answer, options.score_budget_fraction, seed)
    for name, values in scores.items():
        signals[f"method:{name}"] = values[lo:hi]
    seconds["methods"] = time.perf_counter() - t0
    return SampleSignals(
        sample.sample_id,
        n,
        len(answer),
        windows,
        base_nll,
        delta,
        full_correct,
        flips,
        labels,
        signals,
        errors,
        seconds,
        options.occluded,
        lo,
        answer if options.trace == "self" else None,
    )


def _answer_correct(
    engine: Engine, task, sample, cache: Prefix, start: int, context: list[int], options: SignalOptions
) -> bool:
    tokens = _greedy(engine, cache, start, context, options.flip_tokens)
    text = _cut_at_stop(engine.tokenizer.decode(tokens, skip_special_tokens=True), tuple(task.stop))
    return bool(task.score(sample, text).correct)
