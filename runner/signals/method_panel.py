"""Several eviction methods observing one session: the engine runs the union of their ``Needs`` once,
and each member receives exactly the observation fields it declared, as if it ran alone.

Used by the signal study (``runner/signals/study.py``) to read every registered method's scores on the same
full cache in one pass instead of one pass per method. What a member sees differs from a solo run only
where the union changes the kernel: when some member needs ``eager`` the model runs eager for all, and
a non-eager member's attention rows are the last ``attention_window`` rows of the eager kernel's
weights (equal to the rows computed from q and K, up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvleague.engine.contract import EvictionMethod, Needs, Observation, SequenceInfo


def union_needs(methods: Sequence[EvictionMethod]) -> Needs:
    needs = [m.needs for m in methods]
    return Needs(
        hidden_states=any(n.hidden_states for n in needs),
        new_keys_values=any(n.new_keys_values for n in needs),
        queries=any(n.queries for n in needs),
        attention=any(n.attention for n in needs),
        attention_window=max((n.attention_window for n in needs if n.attention), default=1),
        eager=any(n.eager for n in needs),
        ordered_slots=True,
    )


@dataclass
class MethodPanel(EvictionMethod):
    """Fan-out of observations to ``members`` (name -> method). Never scored by the engine itself:
    the caller reads each member's ``score`` on the cache it wants to study."""

    members: dict[str, EvictionMethod] = field(default_factory=dict)

    name = "method_panel"

    def __post_init__(self) -> None:
        # an instance attribute over the ClassVar: the engine reads method.needs, which a panel has per instance
        self.needs = union_needs(list(self.members.values()))  # pyright: ignore[reportAttributeAccessIssue]

    def hidden_layers(self, n_layers: int) -> Sequence[int]:
        layers: set[int] = set()
        for m in self.members.values():
            if m.needs.hidden_states:
                layers.update(m.hidden_layers(n_layers))
        return sorted(layers)

    def reset(self, info: SequenceInfo) -> None:
        super().reset(info)
        for m in self.members.values():
            m.reset(info)

    def observe(self, obs: Observation) -> None:
        for m in self.members.values():
            m.observe(_restricted(obs, m))

    def params(self) -> dict:
        return {name: m.params() for name, m in self.members.items()}


def _restricted(obs: Observation, method: EvictionMethod) -> Observation:
    """The observation ``method`` would have received alone (only the fields it declared)."""
    needs = method.needs
    attention = None
    if needs.attention and obs.attention is not None:
        attention = obs.attention if needs.eager else [rows[:, -needs.attention_window :] for rows in obs.attention]
    hidden = None
    if needs.hidden_states and obs.hidden_states is not None:
        hidden = {layer: obs.hidden_states[layer] for layer in method.hidden_layers(len(obs.cache_positions))}
    return replace(
        obs,
        hidden_states=hidden,
        new_keys=obs.new_keys if needs.new_keys_values else None,
        new_values=obs.new_values if needs.new_keys_values else None,
        queries=obs.queries if needs.queries else None,
        attention=attention,
    )
