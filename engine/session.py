"""One sequence on one KV cache: prefill here, decoding through the one decode loop (``decode.py``).

A session can be fed and decoded repeatedly (multi-turn episodes keep the same cache, so an eviction
in turn 1 affects turn 5). Each prefill chunk goes in with explicit RoPE positions (true positions,
or cache-length positions under ``positions: compact``) and storage slots after the cached ones (so
the causal mask is right for a shrunken cache); the method observes what it declared in ``Needs``;
then, when the budget says so, the method scores the cache and the engine keeps the best slots among
the evictable ones, moving the cache entries in place (``engine/cache.py``). Decode steps run
the same track / observe / evict sequence in :class:`~engine.decode.DecodeLoop`, as a batch
of one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import torch

from kvleague.engine.contract import EvictionMethod, Observation, SequenceInfo
from kvleague.engine.decode import DecodeLoop, DecodeOutput, suppressed
from kvleague.engine.errors import KvleagueError
from kvleague.engine.probe import AttentionRecorder, recording
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.engine.resources import PeakMemory, Spans
from kvleague.engine.to_device import to_device


@dataclass
class GenerationResult:
    """One sequence's completion and instrumentation (all counts over the whole session)."""

    completion: str
    token_ids: list[int]
    stop_reason: str
    method: str
    params: dict
    budget: int
    attn_implementation: str
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds_mean: float
    decode_seconds_p50: float
    decode_seconds_p95: float
    tokens_per_second: float
    method_seconds: float
    evictions: int
    evicted_tokens: int
    #: evictions in which the method's ranking decided what stayed (some of its candidates kept,
    #: some dropped); the others dropped nothing or every candidate, as the protocol dictated
    ranked_evictions: int
    peak_cache_entries: int
    peak_kv_bytes: int
    peak_memory_bytes: int
    peak_memory_source: str
    #: the engine's share of ``method_seconds``: protection, top-k and moving the cache entries
    #: (``method_seconds`` = the method's observe + score, plus this)
    selection_seconds: float
    #: per layer: ``[T]`` absolute positions when all heads agree, else ``[H][T]``
    kept_positions: list = field(repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


class Session:
    """One sequence on one KV cache. Use as a context manager (it installs and removes hooks)."""

    def __init__(self, engine, method: EvictionMethod, budget: int, protocol: Protocol, seed: int):
        if protocol.budget_base != "none":
            raise KvleagueError(
                f"budget_base: {protocol.budget_base!r} is resolved per prompt before a session starts "
                "(Protocol.for_prompt); a session takes an absolute budget, allowed: none"
            )
        protocol.check_budget(budget)
        self.engine, self.method, self.budget, self.protocol, self.seed = engine, method, budget, protocol, seed
        needs = method.needs
        self.attn_implementation = "eager" if needs.eager else engine.attn_implementation
        # slabs sized for the budget plus the most one forward pass appends before an eviction
        per_pass = max(protocol.buffer + 1, protocol.prefill_chunk or 1)
        self.cache = engine.backend.new_cache(reserve=budget + per_pass)
        self.ordered_slots = needs.ordered_slots and not (needs.order_free_scores and engine.backend.reorders_slots)
        self.keeps_fewer = needs.keeps_fewer
        self.generator = torch.Generator(device=engine.device).manual_seed(seed)
        self.hidden_layers = sorted(set(method.hidden_layers(engine.n_layers))) if needs.hidden_states else []
        wants_probe = needs.queries or needs.new_keys_values or needs.attention
        self.recorder = (
            AttentionRecorder(
                engine.n_layers,
                queries=needs.queries,
                new_keys_values=needs.new_keys_values,
                attention=needs.attention,
                window=needs.attention_window,
                all_queries=needs.eager,
                attention_sum=needs.eager and needs.attention_sum,
            )
            if wants_probe
            else None
        )
        self.hidden: dict[int, torch.Tensor] = {}
        self.next_position = 0  # absolute position of the next token
        self.pending: list[int] = []  # generated tokens not yet fed through the model
        self.logits: torch.Tensor | None = None
        #: called with each token as decoding chooses it (``decode``'s ``on_token``)
        self.on_token: Callable[[int], None] | None = None
        self.generated: list[int] = []
        self.outputs: list[DecodeOutput] = []
        self.prompt_tokens = 0
        #: ``scope: context``: the first feed (the context) was compressed; nothing is evicted after it
        self.context_done = False
        self.prefill_seconds = 0.0
        self.step_seconds: list[float] = []
        #: the method's observe + score and the engine's selection (both), and the selection alone
        self.method_time, self.selection_time = Spans(), Spans()
        self.evictions = 0
        self.evicted_tokens = 0
        self.peak_entries = 0
        self.peak_kv_bytes = 0
        self.memory = PeakMemory(engine.device)
        self._stack = ExitStack()
        backend = engine.backend
        method.reset(
            SequenceInfo(
                n_layers=engine.n_layers,
                n_heads=engine.n_heads,
                n_kv_heads=engine.n_kv_heads,
                head_dim=engine.head_dim,
                hidden_size=backend.hidden_size,
                budget=budget,
                seed=seed,
                device=engine.device,
                dtype=backend.dtype,
                model=getattr(backend, "model", None),
                ratio=protocol.ratio,
                ordered_slots=self.ordered_slots,
            )
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Session:
        self._stack.enter_context(
            self.engine.backend.observing(self.attn_implementation, self.hidden_layers, self._on_hidden)
        )
        self._stack.enter_context(recording(self.recorder))
        self._stack.enter_context(torch.inference_mode())
        self.memory.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _on_hidden(self, layer: int, output: torch.Tensor) -> None:
        self.hidden[layer] = output[0]

    # -- feeding and decoding ------------------------------------------------------------------

    def feed(self, token_ids: list[int]) -> None:
        """Append prompt (or tool-observation) tokens, compressing after each prefill chunk (under
        ``scope: context``, the first feed only: it is the context; later feeds go in uncompressed)."""
        if not token_ids:
            raise KvleagueError("prompt: empty token list")
        clock = self.engine.clock
        start = clock()
        self.flush_pending()
        chunk = self.protocol.prefill_chunk or len(token_ids)
        for i in range(0, len(token_ids), chunk):
            self._prefill(token_ids[i : i + chunk])
            if self.over_budget("prefill"):
                self._evict("prefill")
        self.prompt_tokens += len(token_ids)
        self.prefill_seconds += clock() - start
        self.context_done = self.protocol.scope == "context"

    def decode(self, settings: GenerationSettings, on_token: Callable[[int], None] | None = None) -> DecodeOutput:
        """Generate until EOS, a stop string or ``max_new_tokens``; ``on_token`` sees each token as it
        is chosen (streaming output, progress)."""
        if self.logits is None:
            raise KvleagueError("decode: feed a prompt first")
        self.flush_pending()
        self.on_token = on_token
        try:
            DecodeLoop(self.engine, [self], settings).run()
        finally:
            self.on_token = None
        return self.outputs[-1]

    def teacher_force(self, token_ids: list[int], on_logits: Callable[[torch.Tensor, int], None]) -> None:
        """Append ``token_ids`` as if this session had decoded them: ``on_logits(logits, token)`` sees
        the distribution the model predicts each token from, and the method observes and evicts at
        exactly the points :meth:`decode` would (the last token stays pending, as a decoded one does)."""
        if self.logits is None:
            raise KvleagueError("teacher_force: feed a prompt first")
        if not token_ids:
            return
        self.flush_pending()
        DecodeLoop(
            self.engine, [self], GenerationSettings(max_new_tokens=len(token_ids)), [(token_ids, on_logits)]
        ).run()

    def flush_pending(self) -> None:
        """Feed the previous decode's last token, which sampling produced but no forward pass saw."""
        if self.pending:
            pending, self.pending = self.pending, []
            DecodeLoop(self.engine, [self], GenerationSettings()).feed(pending)

    def sample_token(self, logits: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
        """The next token from ``logits`` under ``settings`` (greedy, or sampled with this session's
        generator), a 0-d tensor on the logits' device: the caller reads a batch's tokens at once."""
        logits = suppressed(logits, settings)
        if settings.greedy:
            return torch.argmax(logits)
        probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
        if settings.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= settings.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return order[choice][0]
        return torch.multinomial(probs, 1, generator=self.generator)[0]

    # -- the pieces of a step that prefill and the decode loop share -----------------------------

    @property
    def never_evicts(self) -> bool:
        """Nothing is left to evict: the method keeps everything, or (``scope: context``) the context
        was compressed and what follows it stays whole (the decode loop then observes nothing)."""
        return self.method.never_evicts or self.context_done

    def over_budget(self, phase: str) -> bool:
        """Whether the cache must be compressed now: above B after a prefill chunk, above B + the
        cadence's buffer after a decode step (never for a method that never evicts)."""
        if self.never_evicts:
            return False
        return self.cache.length > self.budget + (self.protocol.buffer if phase == "decode" else 0)

    def after_forward(self, positions: torch.Tensor, prompt: bool, rss: int | None = None) -> None:
        """Book the tokens a forward pass appended at absolute ``positions`` (``rss``: the process's
        resident memory read once for a whole batch, as ``PeakMemory.sample`` takes it)."""
        self.cache.track(positions, prompt)
        self.count_appended(positions.shape[-1], rss)

    def count_appended(self, n: int, rss: int | None = None) -> None:
        """Book ``n`` tokens the cache has just tracked (``after_forward`` without the tracking)."""
        self.next_position += n
        self.peak_entries = max(self.peak_entries, self.cache.length)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.cache.kv_bytes())
        self.memory.sample(rss)

    @property
    def method_seconds(self) -> float:
        return self.method_time.seconds

    @property
    def selection_seconds(self) -> float:
        return self.selection_time.seconds

    def apply_scores(self, scores: torch.Tensor, scoring: tuple) -> None:
        """Keep the best slots by ``scores`` (the engine's selection and moves), and book the time."""
        start = self.engine.mark()
        dropped = self.cache.evict(
            scores,
            self.budget,
            self.protocol,
            self.next_position - 1,
            ordered=self.ordered_slots,
            keeps_fewer=self.keeps_fewer,
        )
        self.book_eviction(dropped, scoring, (start, self.engine.mark(), 1.0))

    def book_eviction(self, dropped: int, scoring: tuple, selection: tuple) -> None:
        """Count an eviction of this session's cache and its time: the
        method's scoring and the engine's selection, each ``(start mark, end mark, this session's share)``."""
        self.evicted_tokens += dropped
        self.evictions += 1
        self.method_time.add(*scoring)
        self.method_time.add(*selection)
        self.selection_time.add(*selection)

    def _prefill(self, token_ids: list[int]) -> None:
        engine, cache = self.engine, self.cache
        c = len(token_ids)
        length = cache.length
        positions = torch.arange(self.next_position, self.next_position + c, device=engine.device)
        rope = (
            positions
            if self.protocol.positions == "absolute"
            else torch.arange(length, length + c, device=engine.device)
        )
        if self.recorder is not None:
            self.recorder.start(c)
        self.logits = engine.backend.forward(to_device([token_ids], engine.device), rope[None], cache.cache, length)[0]
        self.after_forward(positions, prompt=True)
        if self.never_evicts:
            return
        start = engine.mark()
        rec = self.recorder
        self.method.observe(
            Observation(
                phase="prefill",
                new_positions=positions,
                new_token_ids=torch.tensor(token_ids),
                cache_positions=cache.positions,  # immutable: an eviction makes new bookkeeping
                hidden_states={layer: self.hidden[layer] for layer in self.hidden_layers}
                if self.hidden_layers
                else None,
                new_keys=rec.k_new if rec and rec.new_keys_values else None,
                new_values=rec.v_new if rec and rec.new_keys_values else None,
                queries=rec.q if rec and rec.queries else None,
                attention=rec.rows if rec and rec.attention else None,
            )
        )
        self.method_time.add(start, engine.mark())

    def _evict(self, phase: str) -> None:
        start = self.engine.mark()
        scores = self.method.score(self.cache.view(self.budget, phase, self.next_position - 1))
        self.apply_scores(scores, (start, self.engine.mark(), 1.0))

    # -- results -------------------------------------------------------------------------------

    def result(self) -> GenerationResult:
        steps = sorted(self.step_seconds)
        decode_total = sum(steps)
        return GenerationResult(
            completion="".join(o.text for o in self.outputs),
            token_ids=list(self.generated),
            stop_reason=self.outputs[-1].stop_reason if self.outputs else "",
            method=self.method.name,
            params=self.method.params(),
            budget=self.budget,
            attn_implementation=self.attn_implementation,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=len(self.generated),
            prefill_seconds=self.prefill_seconds,
            decode_seconds_mean=decode_total / len(steps) if steps else 0.0,
            decode_seconds_p50=_quantile(steps, 0.5),
            decode_seconds_p95=_quantile(steps, 0.95),
            tokens_per_second=len(steps) / decode_total if decode_total else 0.0,
            method_seconds=self.method_seconds,
            selection_seconds=self.selection_seconds,
            evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
            ranked_evictions=self.cache.ranked_evictions,
            peak_cache_entries=self.peak_entries,
            peak_kv_bytes=self.peak_kv_bytes,
            peak_memory_bytes=self.memory.peak,
            peak_memory_source=self.memory.source,
            kept_positions=self.kept_positions(),
        )

    def kept_positions(self) -> list:
        out = []
        for pos in self.cache.positions:
            pos = pos.sort(dim=-1).values  # slot order carries no meaning
            out.append(pos[0].tolist() if bool((pos == pos[:1]).all()) else pos.tolist())
        return out


def prompt_parts(tokenizer, prompt: str | list[int] | tuple[list[int], ...]) -> list[list[int]]:
    """A prompt as the id lists fed one after the other: text encoded without special tokens, a list
    of ids as one part, a tuple (context, question) as its non-empty parts."""
    if isinstance(prompt, str):
        return [tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    if isinstance(prompt, tuple):
        return [list(part) for part in prompt if len(part)]
    return [list(prompt)]


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]
