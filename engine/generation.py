"""The engine: generation under a hard KV budget over one backend (``engine/backend.py``).

``Engine.session`` opens one sequence with one KV cache (``engine/session.py``);
``Engine.generate`` is feed-then-decode for a single prompt; ``Engine.generate_batch``
(``engine/batch.py``) decodes many such sequences together through the same decode loop
(``engine/decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvleague.engine.backend import HFBackend
from kvleague.engine.contract import EvictionMethod
from kvleague.engine.decode import DecodeOutput
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.engine.resources import device_clock
from kvleague.engine.session import GenerationResult, Session, prompt_parts

__all__ = ["DecodeOutput", "Engine", "GenerationResult", "Session"]


class Engine:
    """A model behind a backend, and the sessions that generate on it.

    ``Engine(model, tokenizer, attn_implementation)`` wraps a Hugging Face model in :class:`HFBackend`;
    ``Engine(backend=...)`` takes any backend. The model facts the engine's users read (``n_layers``,
    ``n_heads``, ``n_kv_heads``, ``head_dim``, ``device``, ``tokenizer``, ``eos_ids``) are the backend's."""

    def __init__(self, model=None, tokenizer=None, attn_implementation: str = "sdpa", *, backend=None):
        self.backend = backend if backend is not None else HFBackend(model, tokenizer, attn_implementation)
        b = self.backend
        self.tokenizer = b.tokenizer
        self.attn_implementation = b.attn_implementation
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = b.n_layers, b.n_heads, b.n_kv_heads, b.head_dim
        self.device = b.device
        #: token ids that end a decode (a benchmark clears them to decode a fixed number of tokens)
        self.eos_ids = set(b.eos_ids)
        #: the clock of every timing the engine reports (synchronizes the device first): prefill and
        #: whole decode steps
        self.clock = device_clock(self.device)

    def mark(self):
        """A point in time inside a decode step (the method's observe / score / selection), read later
        through :class:`~engine.resources.Spans`: on CUDA an event recorded on the stream (the
        host does not wait for the device), elsewhere a reading of :attr:`clock`."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    @classmethod
    def on(cls, model, tokenizer, attn_implementation: str, backend: str) -> Engine:
        """A loaded Hugging Face ``model`` behind ``backend`` (``BACKENDS``)."""
        from kvleague.engine import check_backend

        check_backend(backend)
        if backend == "slab":
            from kvleague.engine.slab import SlabBackend

            return cls(backend=SlabBackend(model, tokenizer, attn_implementation))
        return cls(model, tokenizer, attn_implementation)

    def with_backend(self, backend: str) -> Engine:
        """This engine's model behind ``backend``: one model object (and whatever was compiled for it)
        shared by both engines."""
        return Engine.on(self.backend.model, self.tokenizer, self.attn_implementation, backend)

    def session(self, method: EvictionMethod, budget: int, protocol: Protocol | None = None, seed: int = 0) -> Session:
        return Session(self, method, budget, protocol or Protocol(), seed)

    def generate(
        self,
        prompt: str | list[int] | tuple[list[int], ...],
        method: EvictionMethod,
        budget: int,
        protocol: Protocol | None = None,
        settings: GenerationSettings | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        """Feed ``prompt`` and decode. A tuple of id lists is fed part by part (a context, then its
        question: ``scope: context`` compresses the first part only)."""
        with self.session(method, budget, protocol, seed) as session:
            for part in prompt_parts(self.tokenizer, prompt):
                session.feed(part)
            session.decode(settings or GenerationSettings())
            return session.result()

    def generate_batch(
        self,
        prompts: list[str | list[int]],
        methods: list[EvictionMethod],
        budget: int | list[int],
        protocol: Protocol | None = None,
        settings: GenerationSettings | None = None,
        seeds: list[int] | None = None,
        batch_size: int | None = None,
        on_result: Callable[[int, GenerationResult], None] | None = None,
        max_batch_size: int | None = None,
    ) -> list[GenerationResult]:
        """:meth:`generate` for many prompts, decoded ``batch_size`` at a time (``None``: what fits in
        memory, at most ``max_batch_size``, default ``batch.MAX_AUTO_BATCH``), a finished sequence's row
        taken by the next prompt. ``methods[i]`` is prompt i's own instance, ``seeds[i]`` its seed
        (default 0), ``budget`` one for all or ``budget[i]`` prompt i's; ``on_result(i, result)`` is
        called as prompt i finishes. Result i equals ``generate(prompts[i], methods[i], budget[i],
        protocol, settings, seeds[i])`` in tokens and kept positions; see ``engine/batch.py``."""
        from kvleague.engine.batch import generate_batch  # batch.py builds on this module's sessions

        return generate_batch(
            self, prompts, methods, budget, protocol, settings, seeds, batch_size, on_result, max_batch_size
        )

    # -- for users above the engine: what the backend is, and whole-sequence passes -----------------

    @property
    def model(self):
        """The Hugging Face backend's model, for oracles and anchors (``model.generate``, kvpress); the
        engine's own loops reach it only through the backend."""
        return self.backend.model

    @property
    def layers(self):
        """The Hugging Face backend's decoder layers (kvpress's scorers take an attention module)."""
        return self.backend.layers

    def describe(self) -> dict:
        """Provenance of the backend and model (``HFBackend.describe``)."""
        return self.backend.describe()

    def sequence_logits(self, ids: list[int], predicting: list[int]):
        """Full-cache logits ``[len(predicting), V]`` at positions ``predicting`` of one pass over ``ids``."""
        return self.backend.sequence_logits(ids, predicting)
