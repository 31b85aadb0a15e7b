"""EpiKV (EpiKV-Flat): evict the tokens where the residual stream "settles" between two depths.

Also home of the machinery shared by the EpiKV family (``epikv_bands``, ``epikv_seg``): the
per-token hidden-state change signal and the causal rolling z-score (the frozen per-position table is
``methods.kernels.PositionTable``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo, batch_hidden
from kvleague.engine.deferred_reads import post_floats
from kvleague.engine.errors import KvleagueError
from kvleague.methods.kernels import PositionTable
from kvleague.methods.registry import register_method

#: added to the score of a ``value_reserve`` token: far above any z-score difference (|z| < sqrt(W))
RESERVE_OFFSET = 1e9


def depth_to_layer(fraction: float, n_layers: int) -> int:
    """Relative depth -> decoder layer index: Python ``round`` (half to even), clamped to the model."""
    return min(n_layers - 1, max(0, round(fraction * n_layers)))


def rolling_zscore(history: Sequence[float], new: torch.Tensor, window: int) -> torch.Tensor:
    """Causal rolling z-score of each value of ``new`` (float64 ``[C]``) given the ``history`` before it.

    z_t = (x_t - mean(S_t)) / (std(S_t) + 1e-6) where S_t is the window of the last ``window`` values
    of the series **ending at and including** x_t (fewer at the start of the series), and std is the
    population standard deviation (ddof = 0), so a window of one value gives z = 0, never NaN.
    Only ``history[-(window - 1):]`` matters.
    """
    c = new.shape[0]
    past = torch.tensor(list(history)[-(window - 1) :] if window > 1 else [], dtype=torch.float64)
    series = torch.cat([past, new.to(torch.float64)])
    pad = window - 1 - past.shape[0]
    valid = torch.ones(series.shape[0], dtype=torch.float64)
    if pad > 0:
        series = torch.cat([torch.zeros(pad, dtype=torch.float64), series])
        valid = torch.cat([torch.zeros(pad, dtype=torch.float64), valid])
    windows = series.unfold(0, window, 1)[-c:]  # [C, W], row i ends at new[i]
    mask = valid.unfold(0, window, 1)[-c:]
    n = mask.sum(dim=1)
    mean = (windows * mask).sum(dim=1) / n
    var = (((windows - mean[:, None]) * mask) ** 2).sum(dim=1) / n
    return (new.to(torch.float64) - mean) / (var.sqrt() + 1e-6)


class _RollingZ:
    """Rolling z-score state for one series (the last ``window`` values).

    ``reference=True`` evaluates the formula exactly as the authors' ``_rolling_z_score`` does, value
    by value in Python floats: mean = sum(chunk) / n (left-to-right sum), var = sum((x - mean)^2) / n,
    z = (x - mean) / (var ** 0.5 + 1e-6), z = 0 for a one-value chunk. ``reference=False`` is
    kvleague's float64 variant (exactly rounded sums, vectorised over a prefill chunk)."""

    def __init__(self, window: int, reference: bool = True):
        self.window = window
        self.reference = reference
        self.values: deque[float] = deque(maxlen=window)

    def push(self, new: torch.Tensor) -> torch.Tensor:
        """z of every new value (float64 CPU ``[C]``), then append them to the series."""
        if self.reference or new.shape[0] == 1:
            return torch.tensor([self.push_one(x) for x in new.tolist()], dtype=torch.float64)
        z = rolling_zscore(self.values, new, self.window)
        self.values.extend(float(v) for v in new[-self.window :])
        return z

    def push_one(self, x: float) -> float:
        """z of one new value, then append it (the decode hot path: plain Python over <= W floats)."""
        self.values.append(x)
        n = len(self.values)
        if self.reference:
            if n < 2:
                return 0.0
            mu = sum(self.values) / n
            var = sum((v - mu) ** 2 for v in self.values) / n
            return (x - mu) / (var**0.5 + 1e-6)
        mean = math.fsum(self.values) / n
        var = math.fsum((v - mean) ** 2 for v in self.values) / n
        return (x - mean) / (math.sqrt(var) + 1e-6)


def value_range(cache: CacheView) -> torch.Tensor:
    """``[T]``: max - min over head_dim of each value vector, averaged over KV heads and layers."""
    total = None
    for v in cache.values:
        r = (v.amax(dim=-1) - v.amin(dim=-1)).float().mean(dim=0)
        total = r if total is None else total + r
    assert total is not None, "a cache has at least one layer"
    return total / len(cache.values)


@dataclass
class EpiKVFamily(EvictionMethod):
    """Shared engine of the EpiKV family (not registered itself).

    Two groups of decoder layers, A and B. For each generated token t and layer l,
    d_t^l = ||h_t^l - h_{t-1}^l||_2 with h^l HF's ``hidden_states[l + 1]`` (so the last layer's is
    after the model's final norm), h_{t-1} being the previous token's (for the first generated token:
    the last prompt token's); the group signal is the mean of d over the group's layers; each group
    signal is z-scored causally (see :class:`_RollingZ`); score_t = w_A * z_A(t) - w_B * z_B(t),
    computed once when token t is fed and frozen (stored by absolute position). One global ``[T]``
    score. Fed (prompt) tokens get no score and rank above every generated token (+inf): the
    authors' classes always keep them.

    The defaults are the authors' classes under their harness (``protocol: epikv_paper``);
    kvleague's alternatives are hyperparameters, off by default:

    * ``series``: ``"generated"`` (authors) - only generated tokens enter the z-scored series;
      ``"all"`` - every token that passes through the model does, prompt included, and prompt tokens
      get scores like generated ones (the first token of the sequence has d := 0);
    * ``last_layer``: ``"normed"`` (authors, HF ``hidden_states[n_layers]``) or ``"residual"`` (the
      last decoder layer's output before the final norm);
    * ``arithmetic``: ``"reference"`` (authors) - d in the model's dtype, the z-score in Python floats
      with plain sums, the group mean a Python sum in layer order, the score rounded to float32 (the
      authors' ``torch.tensor(scores, dtype=float32)``); ``"float64"`` - hidden states upcast to
      float32, exactly rounded float64 sums, the score kept in float64.
    """

    # slots in position order, as the authors' cache (attention sums them in order); the scores are
    # each slot's own (frozen, by position)
    needs = Needs(hidden_states=True, order_free_scores=True)

    #: rolling z-score window W (values, including the current one)
    window: int = 64
    #: the N cached generated tokens with the largest value range are never evicted (0 = off)
    value_reserve: int = 0
    series: Literal["generated", "all"] = "generated"
    last_layer: Literal["normed", "residual"] = "normed"
    arithmetic: Literal["reference", "float64"] = "reference"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.value_reserve < 0:
            raise ValueError(f"value_reserve must be >= 0, got {self.value_reserve}")
        for name, allowed in (
            ("series", ("generated", "all")),
            ("last_layer", ("normed", "residual")),
            ("arithmetic", ("reference", "float64")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    # -- to be defined by each member ------------------------------------------------------------

    def groups(self, n_layers: int) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def weights(self) -> tuple[float, float]:
        return 1.0, 1.0

    # -- contract ----------------------------------------------------------------------------------

    def _hook(self, layer: int, n_layers: int) -> int:
        """Engine hidden-state index of decoder layer ``layer`` (``n_layers`` = after the final norm)."""
        return n_layers if layer == n_layers - 1 and self.last_layer == "normed" else layer

    def hidden_layers(self, n_layers: int) -> Sequence[int]:
        a, b = self.groups(n_layers)
        return sorted({self._hook(layer, n_layers) for layer in (*a, *b)})

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        a, b = self.groups(info.n_layers)
        for layer in (*a, *b):
            if not 0 <= layer < info.n_layers:
                raise KvleagueError(f"method {self.name}: layer {layer} outside the model's 0..{info.n_layers - 1}")
        self.group_a, self.group_b = a, b
        self.previous: dict[int, torch.Tensor] = {}  # layer -> hidden state of the last token seen
        reference = self.arithmetic == "reference"
        self.z_a, self.z_b = _RollingZ(self.window, reference), _RollingZ(self.window, reference)
        self.table = PositionTable(fill=float("inf") if self.series == "generated" else 0.0)

    def _change(self, layers: list[int], hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Mean over ``layers`` of d_t^l for the new tokens, float64 CPU ``[C]``."""
        n = self.info.n_layers
        if self.arithmetic == "reference":
            per_layer = []
            for layer in layers:
                h = hidden[self._hook(layer, n)]
                prev = self.previous.get(layer)
                start = h[:1] if prev is None else prev[None]
                per_layer.append((torch.cat([start, h]).diff(dim=0)).norm(dim=-1).tolist())
            return torch.tensor([sum(col) / len(col) for col in zip(*per_layer)], dtype=torch.float64)
        total = None
        for layer in layers:
            h = hidden[self._hook(layer, n)].float()
            prev = self.previous.get(layer)
            # the very first token has no predecessor: d := 0 for it (it still enters the series)
            start = h[:1] if prev is None else prev[None].float()
            d = torch.linalg.vector_norm(torch.diff(torch.cat([start, h]), dim=0), dim=-1)
            total = d if total is None else total + d
        assert total is not None, "at least one layer is observed"
        return (total / len(layers)).double().cpu()

    def observe(self, obs: Observation) -> None:
        if self._decodes_one(obs):  # the path of a batch's decode step, with a batch of one
            EpiKVFamily._observe_decode([self], [obs])
            return
        hidden = obs.hidden_states
        assert hidden is not None, "needs.hidden_states is declared"
        if self.series == "all" or obs.phase == "decode":
            self._push(obs.new_positions, self._change(self.group_a, hidden), self._change(self.group_b, hidden))
        self._remember(hidden)

    def _push(self, positions: torch.Tensor, d_a: torch.Tensor, d_b: torch.Tensor) -> None:
        """z-score the group signals of the new tokens and freeze their scores: token by token
        (:meth:`_push_one`), except a float64 chunk of several, z-scored in one vectorised pass."""
        if self.arithmetic == "reference" or positions.shape[0] == 1:
            for position, a, b in zip(positions.tolist(), d_a.tolist(), d_b.tolist()):
                self._push_one(position, a, b)
            return
        w_a, w_b = self.weights()
        self.table.write(positions, w_a * self.z_a.push(d_a) - w_b * self.z_b.push(d_b))

    def _push_one(self, position: int, d_a: float, d_b: float) -> None:
        """z-score one new token's group signals and freeze its score, in Python floats."""
        w_a, w_b = self.weights()
        score = w_a * self.z_a.push_one(d_a) - w_b * self.z_b.push_one(d_b)
        if self.arithmetic == "reference":
            score = float(np.float32(score))  # the authors' float32 score tensor
        self.table.write_one(position, score)

    def _remember(self, hidden: Mapping[int, torch.Tensor]) -> None:
        n = self.info.n_layers
        for layer in set(self.group_a) | set(self.group_b):
            self.previous[layer] = hidden[self._hook(layer, n)][-1]

    @classmethod
    def observe_batch(cls, methods, observations) -> None:
        """Decode steps of instances with equal hyperparameters: d^l of every sequence in one tensor
        operation per layer (the same elementwise arithmetic as ``_change``); the z-scores stay per
        sequence (each has its own series)."""
        if cls.observe is not EpiKVFamily.observe:
            return super().observe_batch(methods, observations)
        EpiKVFamily._observe_signals(methods, observations)

    def _decodes_one(self, obs: Observation) -> bool:
        """A decode step of one token whose predecessor's hidden states are held."""
        return (
            obs.phase == "decode"
            and obs.new_positions.shape[0] == 1
            and len(self.previous) == len(set(self.group_a) | set(self.group_b))
        )

    @staticmethod
    def _observe_signals(methods, observations) -> None:
        """:meth:`EpiKVFamily.observe` of every sequence, batched where it can be (a subclass that
        observes more calls this, then observes its own)."""
        first = methods[0]
        if all(m._decodes_one(o) and m.params() == first.params() for m, o in zip(methods, observations)):
            EpiKVFamily._observe_decode(methods, observations)
            return
        for method, obs in zip(methods, observations):
            EpiKVFamily.observe(method, obs)

    @staticmethod
    def _observe_decode(methods, observations) -> None:
        """One decode step of sequences with equal hyperparameters: d^l of every sequence in one tensor
        operation per layer (the same elementwise arithmetic as ``_change``) and one copy to the host;
        the z-scores per sequence, in Python floats (each has its own series)."""
        first = methods[0]
        n = first.info.n_layers
        reference = first.arithmetic == "reference"
        layers = sorted(set(first.group_a) | set(first.group_b))
        distance: dict[int, torch.Tensor] = {}
        newest: dict[int, torch.Tensor] = {}  # layer -> every sequence's hidden state, [n, hidden]
        for layer in layers:
            h = newest[layer] = batch_hidden(observations, first._hook(layer, n))[:, -1]
            prev = torch.stack([m.previous[layer] for m in methods])
            distance[layer] = (
                (h - prev).norm(dim=-1) if reference else torch.linalg.vector_norm(h.float() - prev.float(), dim=-1)
            )

        def mean(group: list[int]) -> torch.Tensor:
            total = None
            for layer in group:
                total = distance[layer] if total is None else total + distance[layer]
            assert total is not None, "a layer group is never empty"
            return total / len(group)

        # reference: every layer's d (a Python sum in layer order below); else each group's mean. With
        # the positions, one copy to the host (float64 holds each exactly), read with the step's tokens
        # where the loop allows (see ``post_floats``): the new tokens' scores are frozen then
        columns = [distance[layer] for layer in layers] if reference else [mean(first.group_a), mean(first.group_b)]
        positions = torch.stack([o.new_positions for o in observations])[:, -1]
        rows = {layer: h.unbind(0) for layer, h in newest.items()}  # as _remember
        for i, method in enumerate(methods):
            for layer, row in rows.items():
                method.previous[layer] = row[i]

        def push(host: np.ndarray) -> None:
            if reference:
                row = {layer: host[k].tolist() for k, layer in enumerate(layers)}

                def change(group: list[int]) -> list[float]:
                    return [sum(col) / len(group) for col in zip(*(row[layer] for layer in group))]

                d_a, d_b = change(first.group_a), change(first.group_b)
            else:
                d_a, d_b = host[0].tolist(), host[1].tolist()
            for method, position, a, b in zip(methods, host[-1].tolist(), d_a, d_b):
                method._push_one(int(position), a, b)

        post_floats(torch.stack([c.double() for c in columns] + [positions.to(columns[0].device).double()]), push)

    def token_scores(self, cache: CacheView) -> torch.Tensor:
        """The frozen scores of the cached tokens, float64 ``[T]`` on the cache's device (no host read);
        ``fill`` for a token still to be frozen (the newest, read later: see ``_observe_decode``)."""
        return self.table.read(cache.token_positions, cache.current_position)

    def score(self, cache: CacheView) -> torch.Tensor:
        scores = self.token_scores(cache)
        return self.apply_value_reserve(scores, cache)

    def apply_value_reserve(self, scores: torch.Tensor, cache: CacheView) -> torch.Tensor:
        if self.value_reserve == 0:
            return scores
        scores = scores.cpu()
        generated = ~cache.is_prompt[0][0].cpu()
        n = min(self.value_reserve, int(generated.sum()))
        if n == 0:
            return scores
        ranges = value_range(cache).double().cpu()
        candidates = ranges.masked_fill(~generated, float("-inf"))
        top = torch.topk(candidates, n).indices
        scores = scores.clone()
        scores[top] = RESERVE_OFFSET + ranges[top]
        return scores


@register_method("epikv")
@dataclass
class EpiKV(EpiKVFamily):
    """EpiKV-Flat: score_t = z_A(t) - z_B(t) of the hidden-state change at two depths; frozen; global.

    Signal: d_t^l = ||h_t^l - h_{t-1}^l||_2 with h^l HF's ``hidden_states[l + 1]`` (the output of
    decoder layer l; for the last layer, after the model's final norm). Layer A = ``layer_a`` if set,
    else ``round(depth_a * n_layers)`` (0.3125: layer 10 of 32, the authors' ``band_a_layer``), layer B
    = ``layer_b`` or ``round(depth_b * n_layers)`` (0.656: layer 21 of 32, ``band_b_layer``); Python
    rounding (half to even), clamped to the model. z(t) is the causal rolling z-score over the last
    ``window`` (64) values of each series, the current one included: (x_t - mean) / (std + 1e-6),
    population std, z = 0 while the series holds one value.

    score_t = z_A(t) - z_B(t), computed once when generated token t passes through the model and then
    frozen; one global ``[T]`` score (the same positions are kept in every layer and KV head); the
    prompt is not scored and is kept. No attention weights are used.

    Reference: the authors' ``DetrendendHSVarianceEviction`` (stevenkolawole/epiphany-kv-cache
    ``src/eviction.py``) under their ``scripts/benchmark.py`` harness, which is ``protocol:
    epikv_paper`` here. With that preset and the defaults below, kept positions and greedy tokens are
    identical to the authors' class (``tests/test_epikv_reference.py``; the evidence over 320 decode
    steps on Llama / Qwen2 / Qwen3 is in docs/methods.md). The series (generated tokens only; the first
    one measured against the last prompt token), the last layer's final norm, and the arithmetic (d in
    the model dtype, Python-float z-scores, float32 scores) follow that class; ``series="all"``,
    ``last_layer="residual"`` and ``arithmetic="float64"`` are kvleague's earlier variants (see
    :class:`EpiKVFamily`).

    ``value_reserve`` = N > 0: at each eviction the N cached *generated* tokens with the largest value
    range (max - min over head_dim, averaged over KV heads and layers) get score 1e9 + range, so the
    engine never evicts them. Deviation from the authors' ``value_reserve``: theirs draws the N from
    the generated tokens outside the recent window (kvleague's method does not see the protocol's
    window, so a reserve slot can fall on a recent token, which is kept anyway).

    Where the authors' class is not deterministic kvleague is: when the prompt and the recent window
    together exceed B, the authors' ``topk`` over equal (+inf) recent scores keeps an arbitrary subset
    of the recent window; kvleague keeps its most recent tokens. Exactly equal float32 scores are
    likewise broken towards the more recent position.

    Paper: Kolawole & Smith, arXiv 2606.26472 (EpiKV).
    """

    depth_a: float = 0.3125
    depth_b: float = 0.656
    layer_a: int | None = None
    layer_b: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("depth_a", "depth_b"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("layer_a", "layer_b"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or null, got {value}")

    def groups(self, n_layers: int) -> tuple[list[int], list[int]]:
        a = self.layer_a if self.layer_a is not None else depth_to_layer(self.depth_a, n_layers)
        b = self.layer_b if self.layer_b is not None else depth_to_layer(self.depth_b, n_layers)
        return [a], [b]
