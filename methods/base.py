"""The method contract, defined by the engine (``engine.contract``); re-exported here so that
plugins written as ``from methods.base import EvictionMethod`` keep working."""

from kvleague.engine.contract import CacheView, EvictionMethod, Needs, Observation, Phase, SequenceInfo

__all__ = ["CacheView", "EvictionMethod", "Needs", "Observation", "Phase", "SequenceInfo"]
