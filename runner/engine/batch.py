"""Batched generation: many sequences decoded together, each under its own eviction state.

``Engine.generate_batch`` (:func:`generate_batch`) is ``Engine.generate`` for a list of prompts. Every
sequence keeps everything it has at batch 1: its own :class:`~runner.engine.generation.Session`
(method instance, seed and sampling generator, :class:`~runner.engine.cache.BudgetedCache` with its
kept positions and prompt flags, protected tokens, stop condition, instrumentation) and returns its
own :class:`~runner.engine.generation.GenerationResult`, with the fields of a single run.

How a batch runs:

* **Prefill** is per sequence, through ``Session.feed`` (chunked prefill and prefill-time eviction are
  the single path itself; a prompt chunk is already a matrix product, so batching it buys little).
* **Decode** runs every unfinished sequence through one forward pass per step. Each layer's K/V live
  in one slab ``[N, H, capacity, d]`` whose row i *is* sequence i's cache: its ``BudgetedCache``
  layers are bound to that row (``SlabLayer.bind``), so its evictions move entries in place on the
  row with the single path's code and its slots stay in the single path's order. Rows are packed
  to the left and hold different numbers of slots ``n_i``; row i's new token is written at slot
  ``n_i``, a 2D padding mask (slot <= ``n_i``) hides the rest of the row, and ``position_ids`` are
  per row (the true position, or ``n_i`` under ``positions: compact``). No sequence attends to
  anything it would not attend to alone. SDPA and eager build their 4D mask from the 2D one;
  FlashAttention-2 unpads by it (varlen), so the same code runs under all three kernels.
* A finished sequence (EOS, stop string, ``max_new_tokens``) leaves the batch at once: its row is
  dropped from the slabs, so no step computes a dead row.
* After each step the methods observe and, where a cache is above B (+ the cadence's buffer), score:
  once per method class via ``EvictionMethod.observe_batch`` / ``score_batch``
  (``runner/engine/contract.py``), which loop over the instances unless the class vectorises.
  Selection and moving the entries then run per sequence on its row.
* Sequences whose methods need eager attention (``Needs.eager``) and the others run as separate
  batches, so each runs under the kernel it would use alone.

Teacher forcing (:func:`teacher_force_batch`, the batched ``Session.teacher_force`` that fidelity uses)
is the same loop with each row's next token taken from its script instead of sampled; a script ends
only where it ends (no EOS or stop string).

Multi-turn (agentic) episodes stay at batch 1 (``Engine.session``): each turn's length depends on
the previous turn's tool output, so the sequences of a batch would wait on each other's tools and a
batch would be as slow as its slowest episode at every turn.

Per-sequence instrumentation in a batch: ``decode_seconds_*`` / ``tokens_per_second`` are the
batch's step times (the latency each sequence saw; the batch's throughput is the sum over its
sequences); the method's batched observe / score time is shared equally by the sequences it served;
``peak_memory_bytes`` is the process's (RSS, or CUDA max-allocated), shared by the batch.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from runner.engine.cache import SlabLayer
from runner.engine.contract import BatchCacheView, EvictionMethod, Observation
from runner.engine.errors import KvleagueError
from runner.engine.generation import DecodeOutput, GenerationResult, Session
from runner.engine.probe import BatchAttentionRecorder, recording, wrapper_name
from runner.engine.protocol import GenerationSettings, Protocol

#: the most sequences the automatic batch size puts in one batch
MAX_AUTO_BATCH = 64


def generate_batch(
    engine,
    prompts: Sequence[str | list[int]],
    methods: Sequence[EvictionMethod],
    budget: int,
    protocol: Protocol | None = None,
    settings: GenerationSettings | None = None,
    seeds: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> list[GenerationResult]:
    """Generate a completion for every prompt; result i is what ``engine.generate(prompts[i],
    methods[i], budget, protocol, settings, seeds[i])`` returns (same tokens and kept positions,
    up to float rounding of the batched kernels), computed ``batch_size`` sequences at a time.

    ``methods``: one instance per prompt (distinct objects: each holds its sequence's state).
    ``seeds``: one per prompt (default 0 each, as ``generate``). ``batch_size``: sequences decoded
    together; ``None`` = :func:`auto_batch_size` (what fits in memory)."""
    n = len(prompts)
    if len(methods) != n:
        raise KvleagueError(f"methods: {len(methods)} methods for {n} prompts; give one method instance per prompt")
    check_batch_arguments(methods, batch_size)
    seeds = [0] * n if seeds is None else list(seeds)
    if len(seeds) != n:
        raise KvleagueError(f"seeds: {len(seeds)} seeds for {n} prompts; give one seed per prompt (or none)")
    protocol = protocol or Protocol()
    settings = settings or GenerationSettings()
    protocol.check_budget(budget)
    tokenizer = engine.tokenizer
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise KvleagueError(f"prompts: prompt {i} is an empty token list")
    results: list[GenerationResult | None] = [None] * n
    # one kernel per batch: the sequences run under the attention they would use alone
    groups: dict[bool, list[int]] = defaultdict(list)
    for i, m in enumerate(methods):
        groups[m.needs.eager].append(i)
    for members in groups.values():
        size = batch_size or auto_batch_size(
            engine, [len(ids[i]) for i in members], settings.max_new_tokens, budget, protocol,
            never_evicts=all(methods[i].never_evicts for i in members),
        )
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            sessions = [Session(engine, methods[i], budget, protocol, seeds[i]) for i in chunk]
            if len(chunk) == 1:  # a batch of one is the single path itself
                with sessions[0] as session:
                    session.feed(ids[chunk[0]])
                    session.decode(settings)
            else:
                for session, i in zip(sessions, chunk):
                    with session:
                        session.feed(ids[i])
                _BatchDecode(engine, sessions, settings).run()
            for session, i in zip(sessions, chunk):
                results[i] = session.result()
    return results


def check_batch_arguments(methods: Sequence[EvictionMethod], batch_size: int | None) -> None:
    """What every batched entry point requires: one method instance per sequence (each holds its
    sequence's state) and a positive ``batch_size`` or ``None``."""
    if len({id(m) for m in methods}) != len(methods):
        raise KvleagueError("methods: the same instance appears twice; give each sequence its own instance (it holds per-sequence state)")
    if batch_size is not None and batch_size < 1:
        raise KvleagueError(f"batch_size: must be a positive integer or None (automatic), got {batch_size}")


def teacher_force_batch(
    engine,
    sessions: Sequence[Session],
    token_ids: Sequence[list[int]],
    on_logits: Sequence[Callable[[torch.Tensor, int], None]],
) -> None:
    """``sessions[i].teacher_force(token_ids[i], on_logits[i])`` for every i, decoded together: each
    session sees the same logits and observes and evicts at the same steps as alone. Every session
    must have been fed (and be outside its ``with`` block); sessions whose methods need eager
    attention and the others are forced as separate batches, as in :func:`generate_batch`."""
    if not (len(sessions) == len(token_ids) == len(on_logits)):
        raise KvleagueError(f"teacher_force_batch: {len(sessions)} sessions, {len(token_ids)} token lists and "
                            f"{len(on_logits)} callbacks; give one of each per sequence")
    groups: dict[bool, list[int]] = defaultdict(list)
    for i, s in enumerate(sessions):
        if s.logits is None:
            raise KvleagueError(f"teacher_force_batch: session {i} has not been fed a prompt")
        if s.pending:  # the previous decode's last token, which no forward pass has seen yet
            with s:
                s._flush_pending()
        if token_ids[i]:
            groups[s.method.needs.eager].append(i)
    for members in groups.values():
        if len(members) == 1:
            i = members[0]
            with sessions[i] as s:
                s.teacher_force(token_ids[i], on_logits[i])
            continue
        longest = max(len(token_ids[i]) for i in members)
        forced = [(token_ids[i], on_logits[i]) for i in members]
        _BatchDecode(engine, [sessions[i] for i in members], GenerationSettings(max_new_tokens=longest), forced).run()


def auto_batch_size(
    engine,
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    budget: int,
    protocol: Protocol | None = None,
    never_evicts: bool = False,
    available_bytes: int | None = None,
) -> int:
    """The largest batch whose KV cache and decode activations fit in 80% of the free memory.

    Per sequence: KV = 2 x layers x KV heads x head dim x element size per slot, over the most slots
    the sequence holds (prompt + new tokens without eviction; else max(B + buffer + 1, prompt));
    activations of one decode step: float32 logits over the vocabulary, the MLP's intermediate
    states and one attention row per query head. Free memory: ``available_bytes``, else the CUDA
    device's free memory, else the host's MemAvailable. At least 1, at most the number of prompts
    (and :data:`MAX_AUTO_BATCH`)."""
    if not prompt_tokens:
        return 1
    protocol = protocol or Protocol()
    config = engine.model.config
    element = engine.model.dtype.itemsize
    longest = max(prompt_tokens)
    slots = longest + max_new_tokens if never_evicts else max(budget + protocol.buffer + 1, longest)
    kv = 2 * engine.n_layers * engine.n_kv_heads * engine.head_dim * element * slots
    intermediate = getattr(config, "intermediate_size", 4 * config.hidden_size)
    activations = 4 * config.vocab_size + 4 * element * (config.hidden_size + intermediate) + 4 * engine.n_heads * slots
    if available_bytes is None:
        available_bytes = _free_memory(engine.device)
    fit = int(0.8 * available_bytes) // max(1, kv + activations)
    return max(1, min(fit, len(prompt_tokens), MAX_AUTO_BATCH))


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class _Rows:
    """What every layer of the batched cache shares: each row's slot count before the step."""

    def __init__(self) -> None:
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.index = torch.zeros(0, dtype=torch.long)
        self.longest = 0
        self.equal = True

    def set(self, lengths: list[int], device: torch.device) -> None:
        self.longest = max(lengths)
        self.equal = min(lengths) == self.longest
        if not self.equal:
            self.lengths = torch.tensor(lengths, device=device)
            self.index = torch.arange(len(lengths), device=device)


class BatchSlabLayer(DynamicLayer):
    """One layer of the batched cache: a ``[N, H, capacity, d]`` slab whose row i holds
    ``rows.lengths[i]`` slots; a decode step writes row i's new entry at its own slot."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: _Rows):
        super().__init__()
        self.bind(keys, values)
        self.rows = rows
        self.is_initialized = True

    def bind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.slab_k, self.slab_v = keys, values
        self.dtype, self.device = keys.dtype, keys.device

    def get_seq_length(self) -> int:
        return self.rows.longest

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        rows = self.rows
        if key_states.shape[-2] != 1:
            raise KvleagueError("batched cache: a decode step appends one token per sequence")
        if rows.equal:
            self.slab_k.narrow(-2, rows.longest, 1).copy_(key_states)
            self.slab_v.narrow(-2, rows.longest, 1).copy_(value_states)
        else:
            self.slab_k[rows.index, :, rows.lengths] = key_states[:, :, 0]
            self.slab_v[rows.index, :, rows.lengths] = value_states[:, :, 0]
        self.keys = self.slab_k.narrow(-2, 0, rows.longest + 1)
        self.values = self.slab_v.narrow(-2, 0, rows.longest + 1)
        return self.keys, self.values


class _BatchDecode:
    """Decodes prefilled sessions together until each one stops (see the module docstring)."""

    def __init__(self, engine, sessions: list[Session], settings: GenerationSettings,
                 forced: list[tuple[list[int], Callable[[torch.Tensor, int], None]]] | None = None):
        self.engine, self.sessions, self.settings = engine, sessions, settings
        #: teacher forcing: per session, the tokens fed in place of sampled ones and the callback that
        #: sees each token's predicting logits (``Session.teacher_force``)
        self.forced = forced
        self.device = engine.device
        protocol = sessions[0].protocol
        self.positions_absolute = protocol.positions == "absolute"
        self.attn = sessions[0].attn_implementation
        for s in sessions:
            if not all(isinstance(layer, SlabLayer) for layer in s.cache.cache.layers):
                raise KvleagueError("batched decode: every layer must be a full-attention layer (no sliding-window cache)")
        self.active = list(range(len(sessions)))  # slab row r holds sessions[active[r]]
        self.rows = _Rows()
        self.logits = torch.stack([s.logits for s in sessions])
        self._build_slabs(self._initial_capacity())
        # what the batch must observe: the union of what its methods need
        needs = [s.method.needs for s in sessions if not s.method.never_evicts]
        self.hidden_layers = sorted({layer for s in sessions if not s.method.never_evicts for layer in s.hidden_layers})
        self.hidden: dict[int, torch.Tensor] = {}
        wants = {k: any(getattr(n, k) for n in needs) for k in ("queries", "new_keys_values", "attention")}
        self.recorder = BatchAttentionRecorder(engine.n_layers, **wants) if any(wants.values()) else None
        self.stop_window = 4 * max((len(x) for x in settings.stop), default=0) + 8

    # -- the batched slabs ------------------------------------------------------------------------

    def _initial_capacity(self) -> int:
        """Slots per row: what the longest row can reach (evicting: B + buffer + the step's token;
        otherwise every new token), so the slabs never grow in the usual case."""
        longest = max(s.cache.length for s in self.sessions)
        if all(not s.method.never_evicts for s in self.sessions):
            return max(longest, max(s.budget + s.protocol.buffer for s in self.sessions)) + 1
        return longest + self.settings.max_new_tokens

    def _build_slabs(self, capacity: int) -> None:
        n = len(self.active)
        layers = []
        for l in range(self.engine.n_layers):
            first = self.sessions[self.active[0]].cache.cache.layers[l].keys
            # zeros, not empty: a padded slot is masked, but 0 x NaN garbage would still be NaN
            k = first.new_zeros((n, first.shape[1], capacity, first.shape[-1]))
            v = torch.zeros_like(k)
            for r, i in enumerate(self.active):
                layer = self.sessions[i].cache.cache.layers[l]
                length = layer.keys.shape[-2]
                k[r : r + 1, :, :length].copy_(layer.keys)
                v[r : r + 1, :, :length].copy_(layer.values)
            layers.append(BatchSlabLayer(k, v, self.rows))
        self.cache = DynamicCache(config=self.engine.model.config)
        self.cache.layers = layers
        self.capacity = capacity
        self._bind_rows()

    def _bind_rows(self) -> None:
        for r, i in enumerate(self.active):
            cache = self.sessions[i].cache
            cache.pinned = True
            for layer, batch_layer in zip(cache.cache.layers, self.cache.layers):
                layer.bind(batch_layer.slab_k[r : r + 1], batch_layer.slab_v[r : r + 1], cache.length)

    def _reslab(self, keep_rows: list[int] | None = None, capacity: int | None = None) -> None:
        """Drop the rows not in ``keep_rows`` and/or move to a larger capacity (one copy per layer)."""
        capacity = capacity or self.capacity
        index = torch.tensor(keep_rows, device=self.device) if keep_rows is not None else None
        longest = max(self.sessions[self.active[r]].cache.length for r in (keep_rows if keep_rows is not None else range(len(self.active))))
        for layer in self.cache.layers:
            new = []
            for slab in (layer.slab_k, layer.slab_v):
                if index is not None:
                    slab = slab.index_select(0, index)
                if capacity != slab.shape[-2]:
                    grown = slab.new_zeros((*slab.shape[:-2], capacity, slab.shape[-1]))
                    grown.narrow(-2, 0, longest).copy_(slab.narrow(-2, 0, longest))
                    slab = grown
                new.append(slab)
            layer.bind(*new)
        if keep_rows is not None:
            self.active = [self.active[r] for r in keep_rows]
            self.logits = self.logits.index_select(0, index)
        self.capacity = capacity
        self._bind_rows()

    # -- the decode loop --------------------------------------------------------------------------

    def run(self) -> None:
        engine, model = self.engine, self.engine.model
        with ExitStack() as stack:
            stack.enter_context(torch.inference_mode())
            if self.attn != engine.attn_implementation:
                model.set_attn_implementation(wrapper_name(self.attn))
                stack.callback(model.set_attn_implementation, wrapper_name(engine.attn_implementation))
            for layer in self.hidden_layers:
                module = engine.layers[layer] if layer < engine.n_layers else model.get_decoder().norm
                stack.callback(module.register_forward_hook(self._hidden_hook(layer)).remove)
            stack.enter_context(recording(self.recorder))
            self._loop()

    def _hidden_hook(self, layer: int):
        def hook(module, args, output):
            self.hidden[layer] = output[0] if isinstance(output, tuple) else output

        return hook

    def _loop(self) -> None:
        settings, tokenizer, eos = self.settings, self.engine.tokenizer, self.engine.eos_ids
        tokens: dict[int, list[int]] = {i: [] for i in self.active}
        while self.active:
            step_start = self.engine.clock()
            if self.forced is not None:
                chosen = []
                for r, i in enumerate(self.active):
                    script, on_logits = self.forced[i]
                    token = script[len(tokens[i])]
                    on_logits(self.logits[r], token)
                    chosen.append(token)
            elif settings.greedy:
                chosen = self.logits.argmax(dim=-1).tolist()
            else:
                chosen = [self.sessions[i]._next_token(self.logits[r], settings) for r, i in enumerate(self.active)]
            keep_rows = []
            for r, i in enumerate(self.active):
                own = tokens[i]
                own.append(chosen[r])
                if self.forced is not None:  # a forced script ends only where it ends (no EOS, no stop string)
                    if len(own) < len(self.forced[i][0]):
                        keep_rows.append(r)
                        continue
                    self._finish(i, own, step_start)
                    continue
                reason = "length"
                if chosen[r] in eos:
                    reason = "eos"
                elif settings.stop and any(x in tokenizer.decode(own[-self.stop_window :]) for x in settings.stop):
                    reason = "stop"
                if reason == "length" and len(own) < settings.max_new_tokens:
                    keep_rows.append(r)
                    continue
                self._finish(i, own, step_start)
                text = tokenizer.decode(own, skip_special_tokens=True)
                if reason == "stop":
                    text = text[: min(text.find(x) for x in settings.stop if x in text)]
                self.sessions[i].outputs.append(DecodeOutput(own, text, reason))
            if not keep_rows:
                break
            if len(keep_rows) < len(self.active):
                self._reslab(keep_rows)
            self._forward([chosen[r] for r in keep_rows])
            self._evict()
            took = self.engine.clock() - step_start
            for i in self.active:
                self.sessions[i].step_seconds.append(took)

    def _finish(self, i: int, own: list[int], step_start: float) -> None:
        """Sequence i is done: its last token stays pending (as the single path leaves it)."""
        session = self.sessions[i]
        session.pending = [own[-1]]
        session.step_seconds.append(self.engine.clock() - step_start)
        session.generated.extend(own)

    def _forward(self, token_ids: list[int]) -> None:
        engine, device = self.engine, self.device
        sessions = [self.sessions[i] for i in self.active]
        lengths = [s.cache.length for s in sessions]
        longest = max(lengths)
        if longest + 1 > self.capacity:
            self._reslab(capacity=max(longest + 1, int(self.capacity * 1.5), self.capacity + 256))
        self.rows.set(lengths, device)
        positions = torch.tensor([s.next_position for s in sessions], device=device)
        rope = positions if self.positions_absolute else torch.tensor(lengths, device=device)
        mask = None
        if not self.rows.equal:  # row i sees its own slots 0..n_i (its new token at n_i), nothing beyond
            mask = torch.arange(longest + 1, device=device)[None, :] <= self.rows.lengths[:, None]
        if self.recorder is not None:
            self.recorder.start_batch([n + 1 for n in lengths])
        out = engine.model(
            input_ids=torch.tensor(token_ids, device=device)[:, None],
            position_ids=rope[:, None],
            attention_mask=mask,
            cache_position=torch.tensor([longest], device=device),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.logits = out.logits[:, -1]
        new_positions = positions[:, None]
        for r, s in enumerate(sessions):
            for layer in s.cache.cache.layers:
                layer.set_length(lengths[r] + 1)
            s.cache.track(new_positions[r], False)
            s.next_position += 1
            s.peak_entries = max(s.peak_entries, s.cache.length)
            s.peak_kv_bytes = max(s.peak_kv_bytes, s.cache.kv_bytes())
            s.memory.sample()
        groups: dict[type, list[int]] = defaultdict(list)
        for r, s in enumerate(sessions):
            if not s.method.never_evicts:
                groups[type(s.method)].append(r)
        for cls, members in groups.items():
            start = self.engine.clock()
            cls.observe_batch(
                [sessions[r].method for r in members],
                [self._observation(r, sessions[r], new_positions[r], token_ids[r]) for r in members],
            )
            share = (self.engine.clock() - start) / len(members)
            for r in members:
                sessions[r].method_seconds += share

    def _observation(self, r: int, s: Session, new_positions: torch.Tensor, token: int) -> Observation:
        needs = s.method.needs
        recorded = (
            self.recorder.row(r, needs.queries, needs.new_keys_values, needs.attention) if self.recorder is not None else {}
        )
        return Observation(
            phase="decode",
            new_positions=new_positions,
            new_token_ids=torch.tensor([token]),
            cache_positions=list(s.cache.positions),
            hidden_states={layer: self.hidden[layer][r] for layer in s.hidden_layers} if s.hidden_layers else None,
            **recorded,
        )

    def _evict(self) -> None:
        groups: dict[type, list[int]] = defaultdict(list)
        for r, i in enumerate(self.active):
            s = self.sessions[i]
            if not s.method.never_evicts and s.cache.length > s.budget + s.protocol.buffer:
                groups[type(s.method)].append(r)
        for cls, members in groups.items():
            sessions = [self.sessions[self.active[r]] for r in members]
            start = self.engine.clock()
            views = [s.cache.view(s.budget, "decode", s.next_position - 1) for s in sessions]
            scores = cls.score_batch([s.method for s in sessions], BatchCacheView(views, self._padded(members, views)))
            share = (self.engine.clock() - start) / len(members)
            for s, score in zip(sessions, scores):
                selection = self.engine.clock()
                s.evicted_tokens += s.cache.evict(score, s.budget, s.protocol, s.next_position - 1, ordered=s.ordered_slots)
                s.evictions += 1
                took = self.engine.clock() - selection
                s.method_seconds += share + took
                s.selection_seconds += took

    def _padded(self, members: list[int], views):
        """Builder of ``BatchCacheView.keys`` / ``values`` for slab rows ``members``."""

        def build():
            longest = max(v.length for v in views)
            contiguous = members == list(range(members[0], members[0] + len(members)))
            index = None if contiguous else torch.tensor(members, device=self.device)
            keys, values = [], []
            for layer in self.cache.layers:
                for slab, out in ((layer.slab_k, keys), (layer.slab_v, values)):
                    rows = slab[members[0] : members[-1] + 1] if contiguous else slab.index_select(0, index)
                    out.append(rows[:, :, :longest])
            return keys, values

        return build
