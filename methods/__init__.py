"""Eviction methods. Subclass :class:`EvictionMethod`, decorate with ``@register_method``."""

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, Observation, SequenceInfo
from kvleague.methods.registry import available_methods, build_method, method_class, register_method

__all__ = [
    "CacheView",
    "EvictionMethod",
    "Needs",
    "Observation",
    "SequenceInfo",
    "available_methods",
    "build_method",
    "method_class",
    "register_method",
]
