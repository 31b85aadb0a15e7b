"""kvpress presses as kvleague methods: ``kvpress:<PressName>`` (e.g. ``kvpress:ExpectedAttentionPress``).

A kvpress ``ScorerPress`` (one whose ``compress`` is ScorerPress's own: score, ``topk``, gather) is
bridged: its ``score`` runs on what kvpress's forward hook would hand it (the attention module, the
hidden states entering it, post-RoPE keys and values, the rotary embeddings, the eager attention
weights for ``ObservedAttentionPress``), and kvleague's engine keeps the best slots under its own
budget and protocol (``protocol: kvpress`` for kvpress's pipeline; equal scores keep the newer
position, where kvpress leaves them to ``topk``). The press's dataclass fields, but
``compression_ratio`` (the budget is kvleague's), are the method's hyperparameters, validated by
their types; a ``seed`` left null is the run's seed, so a run is reproducible. Presses that draw from
torch's global generator (``LeverageScorePress``'s Gaussian sketch, ``CompactorPress``) draw from it
seeded with the run's seed at each scoring, the caller's generator state left as it was: the same
run scores the same, whatever ran before it, and kvpress's pipeline after ``torch.manual_seed(seed)``
draws the same sketches.

When a press scores:

* from the keys and values alone (:data:`KEYS_ONLY`): at prefill and at every decode eviction, as
  any kvleague method;
* from the hidden states or attention of the context (all others): at prefill only, the whole
  context in one pass (kvpress compresses once, after its prefill); a decode-time eviction, or a
  chunked prefill, is refused in one line: those presses define no decode-time score.

Presses that are not plain scorers rewrite the cache in their own hooks (``DuoAttentionPress``,
``KVzipPress``, ``ThinKPress``, the wrappers ``AdaKVPress``, ``ComposedPress``...); kvleague's
budgeted cache tracks each slot's position, which such a hook would break, so they are refused in one
line naming why (run them in kvpress's own pipeline). kvpress is imported only when such a name is
resolved (``pip install 'kvleague[kvpress]'``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from typing import Any, ClassVar, Literal

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import kept_at_ratio
from kvleague.methods.registry import METHODS

PREFIX = "kvpress"
#: presses whose score reads only the cached keys and values: they score during decoding too
KEYS_ONLY = frozenset({"KnormPress", "KeyDiffPress", "StreamingLLMPress", "RandomPress", "LagKVPress", "CURPress"})
#: presses whose score reads the attention weights (kvpress runs them under eager attention)
ATTENTION = frozenset({"ObservedAttentionPress"})
_PLAIN = (bool, int, float, str)


def _kvpress():
    try:
        import kvpress
    except ImportError:
        raise KvleagueError(
            "method kvpress:<press>: kvpress is not installed; allowed after pip install 'kvleague[kvpress]'"
        ) from None
    return kvpress


def press_classes() -> dict[str, type]:
    """Every press kvpress exports, by class name."""
    kvpress = _kvpress()
    return {
        n: c
        for n in kvpress.__all__
        if isinstance(c := getattr(kvpress, n), type)
        and issubclass(c, kvpress.BasePress)
        and n not in ("BasePress", "ScorerPress")
    }


def _plain(hint: Any) -> bool:
    """A type a ``--param`` can carry: bool, int, float, str, a Literal of them, or one of them or None."""
    if hint in _PLAIN:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return all(isinstance(a, _PLAIN) for a in args)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        return all(_plain(a) for a in args if a is not type(None))
    return False


def _fields(press: type) -> list[dataclasses.Field]:
    return [
        f for f in dataclasses.fields(press) if f.init and f.name != "compression_ratio" and not f.name.startswith("_")
    ]


def refusal(name: str, press: type) -> str | None:
    """Why ``press`` cannot run as a kvleague method (one line), or None where it is bridged."""
    kvpress = _kvpress()
    if not issubclass(press, kvpress.ScorerPress) or press.compress is not kvpress.ScorerPress.compress:
        return (
            f"method kvpress:{name}: not a plain ScorerPress (it compresses in its own hook, which kvleague's "
            "position-tracking cache cannot follow); run it in kvpress's pipeline"
        )
    hints = typing.get_type_hints(press)
    fields = {f.name for f in _fields(press)}
    for f in _fields(press):
        if not _plain(hints[f.name]):
            return f"method kvpress:{name}: field {f.name} is a {hints[f.name]!r}, not a plain value a --param can set (a wrapper of another press)"
    for arg in inspect.signature(press).parameters.values():  # a hand-written __init__ (CriticalKVPress)
        if arg.name not in fields and arg.name != "compression_ratio" and not arg.name.startswith("_"):
            return f"method kvpress:{name}: field {arg.name} is a {arg.annotation!r}, not a plain value a --param can set (a wrapper of another press)"
    return None


@functools.cache
def press_method(name: str) -> type[EvictionMethod]:
    """The method class of kvpress press ``name`` (one class per press, made once)."""
    presses = press_classes()
    if name not in presses:
        bridged = [n for n, c in presses.items() if refusal(n, c) is None]
        raise KvleagueError(f"method: unknown kvpress press {name!r}; bridged: {', '.join(sorted(bridged))}")
    press = presses[name]
    reason = refusal(name, press)
    if reason is not None:
        raise KvleagueError(reason)
    hints = typing.get_type_hints(press)
    fields = []
    for f in _fields(press):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        fields.append((f.name, hints[f.name], dataclasses.field(default=default)))
    cls = dataclasses.make_dataclass(f"Kvpress_{name}", fields, bases=(KvpressMethod,))
    cls.__module__ = __name__  # pickled by reference: this module's __getattr__ makes it again
    cls.name = f"{PREFIX}:{name}"
    cls.press_class = press
    cls.keys_only = name in KEYS_ONLY
    if name in ATTENTION:
        cls.needs = Needs(hidden_states=True, attention=True, eager=True)
    elif not cls.keys_only:
        cls.needs = Needs(hidden_states=True)
    summary = ((press.__doc__ or "").strip().splitlines() or [""])[0]
    scored = "prefill and decode" if cls.keys_only else "prefill only"
    cls.__doc__ = f"kvpress {name} ({scored}): {summary}"
    return cls


def __getattr__(attr: str) -> Any:
    if attr.startswith("Kvpress_"):
        return press_method(attr.removeprefix("Kvpress_"))
    raise AttributeError(attr)


def catalogue() -> list[dict[str, Any]]:
    """Every kvpress press: bridged ones described as methods, the others with why they are refused."""
    from kvleague.methods.registry import describe

    out = []
    for name, press in sorted(press_classes().items()):
        reason = refusal(name, press)
        out.append({"name": f"{PREFIX}:{name}", "refused": reason} if reason else describe(press_method(name)))
    return out


@dataclasses.dataclass
class KvpressMethod(EvictionMethod):
    """The bridge's base: a kvpress press's ``score``, per layer, on what kvpress's hook would see."""

    press_class: ClassVar[type]
    keys_only: ClassVar[bool] = True

    def hidden_layers(self, n_layers: int) -> range:
        return range(n_layers - 1)  # layer l's output enters layer l + 1; layer 0's input is the embeddings

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        if info.model is None:
            raise KvleagueError(f"method {self.name}: needs a backend with a Hugging Face model; allowed backend: hf")
        params = self.params()
        if params.get("seed", 0) is None:
            params["seed"] = info.seed
        self.press = self.press_class(**params)
        self.model = info.model
        self.decoder = info.model.get_decoder()
        try:
            self.press.post_init_from_model(info.model)
        except Exception as exc:  # a press that loads weights from the Hub, offline: one line
            raise KvleagueError(f"method {self.name}: kvpress could not prepare the press: {exc}") from None
        for layer in self.decoder.layers:  # what kvpress's hook sets: presses read module.rotary_emb
            layer.self_attn.rotary_emb = self.decoder.rotary_emb
        self.context: Observation | None = None
        self.scorings = 0

    def observe(self, obs: Observation) -> None:
        if obs.phase == "prefill" and not self.keys_only:
            self.context = obs

    def score(self, cache: CacheView) -> Any:
        import torch

        # the first scoring draws from the run's seed (as kvpress after torch.manual_seed(seed)), later
        # ones from seeds of their own; the caller's generators are restored
        device = self.info.device
        devices = (
            [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        )
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.info.seed + 1_000_003 * self.scorings)
            self.scorings += 1
            return self._score_all(cache)

    def _score_all(self, cache: CacheView) -> Any:
        import torch

        # presses that cut by the ratio themselves (StreamingLLM, Compactor's blending) see the ratio
        # the budget was given as where it keeps what the engine keeps now (kvpress's prefill), else
        # the one the engine applies
        ratio = self.info.ratio
        if ratio is None or kept_at_ratio(cache.length, ratio) != cache.budget:
            ratio = ratio_keeping(cache.budget, cache.length)
        self.press.compression_ratio = ratio
        if self.keys_only:
            return torch.stack([self._score(l, None, cache, None, {}) for l in range(len(cache.keys))])
        obs = self.context
        if cache.phase != "prefill" or obs is None or obs.new_positions.shape[0] != cache.length:
            raise KvleagueError(
                f"method {self.name}: scores the context from its hidden states, once, after a whole-context "
                "prefill; allowed: protocol kvpress (scope: context, prefill_chunk: null)"
            )
        hidden = self.model.get_input_embeddings()(obs.new_token_ids.to(self.info.device)[None])
        rope = self.decoder.rotary_emb(hidden, obs.new_positions[None])
        scores = []
        entering_layers = obs.hidden_states
        assert entering_layers is not None  # needs.hidden_states
        for l, layer in enumerate(self.decoder.layers):
            if l > 0:
                hidden = entering_layers[l - 1][None]
            entering = layer.input_layernorm(hidden)
            kwargs = {"hidden_states": entering, "position_embeddings": rope, "cache_position": obs.new_positions}
            attentions = obs.attention[l][None].to(entering.dtype) if obs.attention is not None else None
            scores.append(self._score(l, entering, cache, attentions, kwargs))
        self.context = None
        return torch.stack(scores)

    def _score(self, l: int, hidden, cache: CacheView, attentions, kwargs: dict) -> Any:
        """Press scores ``[H, T]`` of layer ``l`` (kvpress's shapes: a batch of one)."""
        module = self.decoder.layers[l].self_attn
        keys, values = cache.keys[l][None], cache.values[l][None]
        return self.press.score(module, hidden, keys, values, attentions, kwargs)[0]


def ratio_keeping(kept: int, length: int) -> float:
    """The ``compression_ratio`` at which kvpress keeps ``kept`` of ``length`` entries
    (``int(length * (1 - ratio)) == kept``, as its ``compute_n_kept`` rounds); 0 when nothing goes."""
    if kept >= length:
        return 0.0
    ratio = 1 - kept / length
    while int(length * (1 - ratio)) < kept:
        ratio = math.nextafter(ratio, 0.0)
    while int(length * (1 - ratio)) > kept:
        ratio = math.nextafter(ratio, 1.0)
    return ratio


METHODS.register_family(PREFIX, press_method)
