"""The one decode loop: a step (forward, track, observe, evict) that any number of sequences run
together, a single sequence being a batch of one.

:class:`DecodeLoop` decodes prefilled sessions (``engine/session.py``) until each stops (EOS,
a stop string, ``max_new_tokens``; under teacher forcing, the end of its script). Every sequence
keeps what it has alone: its own method instance, seed and sampling generator, budgeted cache with
its kept positions and prompt flags, protected tokens, stop condition and instrumentation.

**The KV layout of a step.** One sequence decodes on its own cache (any layer kind the backend's
store holds). Several share one slab per layer, ``[N, H, capacity, d]`` (every layer's K and V are
views of one ``[L, 2, N, H, capacity, d]`` tensor, ``DecodeLoop.kv``), whose row i *is* sequence
i's cache: its ``BudgetedCache`` layers are bound to that row (``SlabLayer.bind``), so its evictions
move entries in place with the single path's code and its slots stay in the single path's order.
Rows are packed to the left and hold different numbers of slots ``n_i``; row i's new token is
written at slot ``n_i``, a 2D padding mask (slot <= ``n_i``) hides the rest of the row, and RoPE
positions are per row (the true position, or ``n_i`` under ``positions: compact``). No sequence
attends to anything it would not attend to alone. SDPA and eager build their 4D mask from the 2D
one; FlashAttention-2 unpads by it (varlen), so the same code runs under all three kernels. A
finished sequence leaves: its row is dropped from the slabs (or kept as padding, ``_retire``), or,
under continuous batching (``refill``: ``generate_batch`` with more prompts than rows), taken by the
next prompt waiting, fed alone between steps and copied into the row: the batch stays full while
prompts wait, and keeps its shapes (a captured step replays).

**Observe and evict.** After the forward pass, the methods observe and, where a cache is above B
(+ the cadence's buffer), score: a method class serving one sequence through ``observe`` /
``score``, several through ``EvictionMethod.observe_batch`` / ``score_batch``
(``engine/contract.py``), which loop over the instances unless the class vectorises.
Selection and moving the entries run for the whole group at once where its rows share a protocol,
slot contract and score shape (``cache_rows.evict_rows``: one top-k over the stacked scores, each row
with its own length and budget, one gather for every layer's slabs, one host read whatever the batch size),
else per sequence on its row (``Session.apply_scores``); both keep the same slots.

Per-sequence instrumentation in a batch: ``decode_seconds_*`` / ``tokens_per_second`` are the
batch's step times (the latency each sequence saw; the batch's throughput is the sum over its
sequences); the method's batched observe / score time is shared equally by the sequences it served;
``peak_memory_bytes`` is the process's (RSS, or CUDA max-allocated), shared by the batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Generic, TypeVar
from typing import Protocol as TypingProtocol

import torch
from transformers.cache_utils import DynamicLayer

from kvleague.engine.cache import BudgetedCache
from kvleague.engine.cache_layers import SlabLayer, held
from kvleague.engine.cache_rows import evict_rows, track_rows
from kvleague.engine.contract import BatchCacheView, EvictionMethod, Observation, RowHidden
from kvleague.engine.deferred_reads import DeferredReads
from kvleague.engine.errors import KvleagueError
from kvleague.engine.probe import BatchAttentionRecorder, recording
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.engine.resources import Spans, current_rss
from kvleague.engine.to_device import to_device


class Sequence(TypingProtocol):
    """What the loop needs of one sequence (``engine.session.Session`` is the one implementation): the
    loop drives sequences through this surface and never names their class, so a session may use the
    loop without the two modules depending on each other."""

    method: EvictionMethod
    budget: int
    protocol: Protocol
    cache: BudgetedCache
    attn_implementation: str
    hidden_layers: list[int]
    ordered_slots: bool
    keeps_fewer: bool
    next_position: int
    pending: list[int]
    generated: list[int]
    logits: torch.Tensor | None
    on_token: Callable[[int], None] | None
    outputs: list[DecodeOutput]
    step_seconds: list[float]
    #: the method's observe + score time (a batched call's shared between the sequences it served)
    method_time: Spans

    @property
    def never_evicts(self) -> bool:
        """Nothing left to evict: the method keeps everything, or the context was compressed (``scope: context``)."""
        ...

    def sample_token(self, logits: torch.Tensor, settings: GenerationSettings) -> torch.Tensor: ...
    def apply_scores(self, scores: torch.Tensor, scoring: tuple) -> None: ...
    def over_budget(self, phase: str) -> bool: ...
    def after_forward(self, positions: torch.Tensor, prompt: bool, rss: int | None = None) -> None: ...
    def count_appended(self, n: int, rss: int | None = None) -> None: ...
    def book_eviction(self, dropped: int, scoring: tuple, selection: tuple) -> None: ...


#: the sequences a loop decodes: it hands each back as given (``on_done``)
S = TypeVar("S", bound=Sequence)


@dataclass
class DecodeOutput:
    token_ids: list[int]
    text: str
    stop_reason: str  # "eos" | "stop" | "length"


#: teacher forcing: per session, the tokens fed in place of sampled ones and the callback that sees
#: each token's predicting logits
Script = tuple[list[int], Callable[[torch.Tensor, int], None]]


class _Rows:
    """What every layer of the batched cache shares: each row's slot count before the step."""

    def __init__(self) -> None:
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.index = torch.zeros(0, dtype=torch.long)
        self.longest = 0
        self.equal = True

    def set(self, lengths: list[int], on_device: torch.Tensor) -> None:
        """``lengths`` on the host, and the same as the device tensor ``on_device``."""
        self.longest = max(lengths)
        self.equal = min(lengths) == self.longest
        if not self.equal:
            self.lengths = on_device
            self.index = torch.arange(len(lengths), device=on_device.device)


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


class DecodeLoop(Generic[S]):
    """Decodes prefilled sessions together until each one stops (see the module docstring).

    ``scripts``: teacher forcing, one :data:`Script` per session (a script ends only where it ends:
    no EOS or stop string). Every session must run under the same attention kernel."""

    def __init__(
        self,
        engine,
        sessions: list[S],
        settings: GenerationSettings,
        scripts: list[Script] | None = None,
        refill: Callable[[], S | None] | None = None,
        on_done: Callable[[S], None] | None = None,
    ):
        self.engine, self.backend, self.settings = engine, engine.backend, settings
        #: every session the loop has decoded, by index (``active`` maps rows to them); one whose row a
        #: refill took is None
        self.sessions: list[S | None] = list(sessions)
        self.scripts = scripts
        #: continuous batching (``generate_batch``): called between steps, outside the batch's hooks,
        #: for the next fed session to take a finished sequence's row (None: none is left). A sequence
        #: that finished here is never fed again: its row goes to the next.
        self.refill = refill
        #: called with each session as its decode ends (its output appended)
        self.on_done = on_done
        if refill is not None and (scripts is not None or len(sessions) < 2):
            raise KvleagueError("decode: refill takes a batch of two or more generated (not teacher-forced) sequences")
        self.device = engine.device
        self.attn = sessions[0].attn_implementation
        self.active = list(range(len(sessions)))  # slab row r holds sessions[active[r]]
        #: one sequence decodes on its own cache; several on shared slabs
        self.shared = len(sessions) > 1
        #: slab rows whose sequence has finished but which stay in the slabs (padding, see ``_retire``)
        self.dead: set[int] = set()
        #: keep finished rows as padding until half the rows are done (a backend whose steps are
        #: captured per batch size: dropping a row would mean capturing anew)
        self.pad_finished = self.shared and self.backend.pads_finished_rows
        self.rows = _Rows()
        #: what the steps' evictions leave to read later, read with the step's tokens
        self.reads = DeferredReads()
        self.logits = torch.stack([self._check_joins(s) for s in sessions])
        #: each session's tokens of this decode
        self.tokens: dict[int, list[int]] = {i: [] for i in self.active}
        if self.shared:
            self._build_slabs(self._capacity_for(sessions))
        self._watch()
        self.stop_window = 4 * max((len(x) for x in settings.stop), default=0) + 8

    def _session(self, i: int) -> S:
        """Session ``i``, one the loop still holds (only a finished one whose row a refill took is let go)."""
        session = self.sessions[i]
        assert session is not None, f"decode: session {i} finished and was let go"
        return session

    def _check_joins(self, session: S) -> torch.Tensor:
        """Check ``session`` may join this batch; its next token's logits (it was fed)."""
        if session.logits is None:
            raise KvleagueError("decode: every session of a batch must be fed a prompt first")
        if session.attn_implementation != self.attn:
            raise KvleagueError("decode: the sessions of one batch run under one attention kernel")
        if self.shared and not all(isinstance(layer, SlabLayer) for layer in session.cache.cache.layers):
            raise KvleagueError("batched decode: every layer must be a full-attention layer (no sliding-window cache)")
        return session.logits

    def _watch(self) -> None:
        """What the batch observes: the union of what its rows' methods need."""
        evicting = [s for s in (self._session(i) for i in self.active) if not s.never_evicts]
        needs = [s.method.needs for s in evicting]
        self.hidden_layers = sorted({layer for s in evicting for layer in s.hidden_layers})
        self.hidden: dict[int, torch.Tensor] = {}
        queries, new_keys_values, attention = (
            any(getattr(n, k) for n in needs) for k in ("queries", "new_keys_values", "attention")
        )
        self.recorder = (
            BatchAttentionRecorder(
                self.engine.n_layers, queries=queries, new_keys_values=new_keys_values, attention=attention
            )
            if queries or new_keys_values or attention
            else None
        )

    # -- the batched slabs ------------------------------------------------------------------------

    def _capacity_for(self, sessions: list[S]) -> int:
        """Slots per row: what the longest of ``sessions`` can reach (evicting: B + buffer + the step's
        token; otherwise every new token), so the slabs never grow in the usual case."""
        longest = max(s.cache.length for s in sessions)
        if all(not s.never_evicts for s in sessions):
            return max(longest, max(s.budget + s.protocol.buffer for s in sessions)) + 1
        return longest + self.settings.max_new_tokens

    def _build_slabs(self, capacity: int) -> None:
        n = len(self.active)
        first = held(self._session(self.active[0]).cache.slab_layers[0].keys)
        # every layer's K and V in one tensor, so that an eviction moves the kept slots of all of them
        # with one gather (cache_rows.evict_rows); zeros, not empty: a padded slot is masked, but 0 x NaN
        # garbage would still be NaN
        self.kv = self.backend.take_slab((self.engine.n_layers, 2, n, first.shape[1], capacity, first.shape[-1]), first)
        self.capacity = capacity
        for r in range(n):
            self._copy_in(r)
        self.cache = self.backend.empty_batch_cache()
        self.cache.layers = [
            self.backend.batch_layer(self.kv[l, 0], self.kv[l, 1], self.rows) for l in range(self.kv.shape[0])
        ]
        self._bind_rows()

    def _copy_in(self, r: int) -> None:
        """Row ``r`` of the slabs takes what its session's own cache holds (one copy where the store
        keeps every layer in one tensor, the slab backend's; else two per layer)."""
        cache = self._session(self.active[r]).cache
        own = cache.slabs()  # [L, 2, 1, H, capacity, d] or None
        if own is not None:
            self.kv[:, :, r : r + 1, :, : cache.length].copy_(own[:, :, :, :, : cache.length])
            return
        for l, layer in enumerate(cache.slab_layers):
            keys, values = held(layer.keys), held(layer.values)
            length = keys.shape[-2]
            self.kv[l, 0, r : r + 1, :, :length].copy_(keys)
            self.kv[l, 1, r : r + 1, :, :length].copy_(values)

    def _bind_rows(self, rows: list[int] | None = None) -> None:
        for r in range(len(self.active)) if rows is None else rows:
            self._session(self.active[r]).cache.adopt(
                [(layer.slab_k[r : r + 1], layer.slab_v[r : r + 1]) for layer in self.cache.layers]
            )

    def _reslab(self, keep_rows: list[int] | None = None, capacity: int | None = None) -> None:
        """Drop the rows not in ``keep_rows`` and/or move to a larger capacity (one copy of the slabs)."""
        capacity = capacity or self.capacity
        index = to_device(keep_rows, self.device) if keep_rows is not None else None
        longest = max(
            self._session(self.active[r]).cache.length
            for r in (keep_rows if keep_rows is not None else range(len(self.active)))
        )
        old = self.kv
        if index is None and capacity == old.shape[-2]:
            kv = old
        else:
            kv = self.backend.take_slab(
                (
                    *old.shape[:2],
                    len(index) if index is not None else old.shape[2],
                    *old.shape[3:-2],
                    capacity,
                    old.shape[-1],
                ),
                old,
            )
            kept = old if index is None else old.index_select(2, index)
            kv.narrow(-2, 0, longest).copy_(kept.narrow(-2, 0, longest))
        for l, layer in enumerate(self.cache.layers):
            layer.bind(kv[l, 0], kv[l, 1])
        if keep_rows is not None:
            assert index is not None  # made from keep_rows above
            self.active = [self.active[r] for r in keep_rows]
            self.logits = self.logits.index_select(0, index)
        self.kv, self.capacity = kv, capacity
        self._bind_rows()
        if kv is not old:  # the dropped rows' sequences may still be bound to theirs
            self.backend.give_slab(old, self._tenants())

    def _tenants(self) -> list[BudgetedCache]:
        return [s.cache for s in self.sessions if s is not None]

    # -- running ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Decode until every session stops (and, with ``refill``, every session it hands over)."""
        while True:
            with self._observing():
                first = self._session(self.active[0]) if self.active else None
                if not self.shared and first is not None and first.never_evicts:
                    # sized for the whole decode at once, as a batch's slabs are (in inference mode,
                    # as its steps: a slab made so is taken again only so)
                    first.cache.expect(first.cache.length + self.settings.max_new_tokens)
                waits = self._loop()
            self.reads.flush()  # before a refill's prompt is fed, and at the end
            if not waits or not self._admit():
                if self.shared:  # the sequences stay bound to their rows until the slabs' next owner
                    self.backend.give_slab(self.kv, self._tenants())
                return

    def feed(self, token_ids: list[int]) -> None:
        """One step over given tokens, one per session (a previous decode's pending last token)."""
        with self._observing():
            self.step(token_ids)
        self.reads.flush()  # what its eviction posted: no token read follows in this loop

    def _observing(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(torch.inference_mode())
        stack.enter_context(self.backend.observing(self.attn, self.hidden_layers, self._on_hidden))
        stack.enter_context(recording(self.recorder))
        return stack

    def _on_hidden(self, layer: int, output: torch.Tensor) -> None:
        self.hidden[layer] = output

    def _loop(self) -> bool:
        """Decode; True when it stopped for sequences to take finished rows (``refill``), False when done."""
        settings, tokenizer, eos = self.settings, self.engine.tokenizer, self.engine.eos_ids
        clock = self.engine.clock
        tokens = self.tokens
        while self.active:
            step_start = clock()
            live = [r for r in range(len(self.active)) if r not in self.dead]
            chosen = [0] * len(self.active)  # what a padding row is fed is never read
            if self.scripts is not None:
                self.reads.flush()  # the last eviction's, before a row's result is taken (else: with the tokens)
                for r in live:
                    script, on_logits = self.scripts[self.active[r]]
                    chosen[r] = script[len(tokens[self.active[r]])]
                    on_logits(self.logits[r], chosen[r])
            elif settings.greedy:
                chosen = self.reads.read(suppressed(self.logits, settings).argmax(dim=-1))
            elif live:  # each row with its own generator, every row's token read at once
                picks = [self._session(self.active[r]).sample_token(self.logits[r], settings) for r in live]
                for r, token in zip(live, self.reads.read(torch.stack(picks))):
                    chosen[r] = token
            keep_rows = []
            for r in live:
                i = self.active[r]
                session = self._session(i)
                own = tokens[i]
                own.append(chosen[r])
                if session.on_token is not None:
                    session.on_token(chosen[r])
                if self.scripts is not None:
                    if len(own) < len(self.scripts[i][0]):
                        keep_rows.append(r)
                    else:
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
                cuts = [text.find(x) for x in settings.stop if x in text] if reason == "stop" else []
                if cuts:  # the completion ends before the first stop string, which it excludes (a special
                    text = text[: min(cuts)]  # token's, such as an end of turn that is no EOS, is skipped already)
                session.outputs.append(DecodeOutput(own, text, reason))
                if self.on_done is not None:
                    self.on_done(session)
            if len(keep_rows) < len(live) and self.refill is not None:
                # the finished rows wait as padding for the next sequences, which are fed between steps
                # (outside this loop's hooks); the others take their step first
                chosen = self._pad(keep_rows, chosen)
                if keep_rows:
                    self._timed_step(chosen, step_start)
                return True
            if not keep_rows:
                break
            if len(keep_rows) < len(live):
                chosen = self._retire(keep_rows, chosen)
            self._timed_step(chosen, step_start)
        return False

    def _timed_step(self, chosen: list[int], step_start: float) -> None:
        self.step(chosen)
        took = self.engine.clock() - step_start
        for r, i in enumerate(self.active):
            if r not in self.dead:
                self._session(i).step_seconds.append(took)

    def _admit(self) -> bool:
        """Finished rows take the next fed sessions (``refill``), each its row's slots; False when no
        sequence is left to decode. Once ``refill`` runs dry, the finished rows leave as ``_retire``
        decides."""
        refill = self.refill
        assert refill is not None  # _loop stops for finished rows to be taken only where a refill is given
        placed: list[tuple[int, int, torch.Tensor]] = []  # (slab row, session, its next token's logits)
        for r in sorted(self.dead):
            session = refill()
            if session is None:
                self.refill = None
                break
            logits = self._check_joins(session)
            self.sessions.append(session)
            self.tokens[len(self.sessions) - 1] = []
            placed.append((r, len(self.sessions) - 1, logits))
        if placed:
            capacity = self._capacity_for([self._session(i) for _, i, _ in placed])
            if capacity > self.capacity:
                self._reslab(capacity=capacity)
            self.logits = self.logits.clone()  # the finished sessions keep views of their rows' logits
            for r, i, logits in placed:
                # the finished sequence is let go (its result was taken when it ended): a group's finished
                # sessions would otherwise hold their methods' state until the loop ends
                self.sessions[self.active[r]] = None
                self.tokens.pop(self.active[r], None)
                self.active[r] = i
                self.dead.discard(r)
                self._copy_in(r)
                self.logits[r] = logits
            self._bind_rows([r for r, _, _ in placed])
            self._watch()
        live = [r for r in range(len(self.active)) if r not in self.dead]
        if not live:
            return False
        if self.dead and self.refill is None:  # nothing waits: the finished rows go as at any step
            self._retire(live, [0] * len(self.active))
        return True

    def _retire(self, keep_rows: list[int], chosen: list[int]) -> list[int]:
        """Rows whose sequence just finished leave the batch; returns the next step's tokens, one per
        slab row. Dropping a row rebuilds the slabs without it; a backend that captures steps per
        batch size (``pads_finished_rows``) keeps finished rows as padding instead (their sequence is
        done: nothing reads what the padded steps compute, and their writes land past their cache's
        length) until fewer than half the rows are live, so a batch of N captures about log2(N)
        times, not N."""
        if self.pad_finished and 2 * len(keep_rows) >= len(self.active):
            return self._pad(keep_rows, chosen)
        self.dead = set()
        self._reslab(keep_rows)
        return [chosen[r] for r in keep_rows]

    def _pad(self, keep_rows: list[int], chosen: list[int]) -> list[int]:
        """The rows not in ``keep_rows`` stay in the slabs as padding; the next step's tokens, one per row."""
        live = set(keep_rows)
        self.dead = {r for r in range(len(self.active)) if r not in live}
        return [chosen[r] if r in live else 0 for r in range(len(self.active))]

    def _finish(self, i: int, own: list[int], step_start: float) -> None:
        """Sequence i is done: its last token stays pending (fed by the session's next call)."""
        session = self._session(i)
        session.pending = [own[-1]]
        session.step_seconds.append(self.engine.clock() - step_start)
        session.generated.extend(own)

    # -- one step -----------------------------------------------------------------------------------

    def step(self, token_ids: list[int]) -> None:
        """Forward one token per slab row, and for each live row track it, let the methods observe,
        evict where over budget (a padding row's token is fed and nothing else)."""
        self.reads.flush()  # an earlier step's, where no token read followed it (sampled, scripted)
        sessions = [self._session(i) for i in self.active]
        lengths = [s.cache.length for s in sessions]
        # the tokens, absolute positions and cache lengths of every row: one copy to the device
        tokens, positions, lengths_t = to_device([token_ids, [s.next_position for s in sessions], lengths], self.device)
        rope = positions if sessions[0].protocol.positions == "absolute" else lengths_t
        mask = None
        if self.shared:
            longest = max(lengths)
            if longest + 1 > self.capacity:
                self._reslab(capacity=max(longest + 1, int(self.capacity * 1.5), self.capacity + 256))
            self.rows.set(lengths, lengths_t)
            if not self.rows.equal:  # row i sees its own slots 0..n_i (its new token at n_i), nothing beyond
                mask = torch.arange(longest + 1, device=self.device)[None, :] <= self.rows.lengths[:, None]
            cache, start_slot = self.cache, longest
        else:
            cache, start_slot = sessions[0].cache.cache, lengths[0]
        if self.recorder is not None:
            slabs = self.kv if self.shared else sessions[0].cache.slabs()  # every layer's keys, one tensor
            self.recorder.start_batch(
                [n + 1 for n in lengths],
                frozenset(
                    r
                    for r, s in enumerate(sessions)
                    if r not in self.dead and s.method.needs.attention and not s.never_evicts
                ),
                None if slabs is None else slabs[:, 0],
            )
        self.logits = self.backend.forward(tokens[:, None], rope[:, None], cache, start_slot, mask, decode=True)
        new_positions = positions[:, None]
        live = {r: s for r, s in enumerate(sessions) if r not in self.dead}  # slab row -> its session
        rss = current_rss() if self.device.type != "cuda" else None  # the process's: one read for the batch
        if self.shared:  # every row's new slot booked at once (its position, a generated token)
            track_rows([s.cache for s in live.values()], positions, list(live))
        logits = self.logits.unbind(0)  # every row's, cut once
        for r, s in live.items():
            if self.shared:
                for layer in s.cache.slab_layers:
                    layer.set_length(lengths[r] + 1)
                s.count_appended(1, rss)
            else:
                s.after_forward(new_positions[r], prompt=False, rss=rss)
            s.logits = logits[r]
        self._observe(live, new_positions, token_ids)
        self._evict(live)

    def _observe(self, sessions: dict[int, S], new_positions: torch.Tensor, token_ids: list[int]) -> None:
        groups: dict[type, list[int]] = defaultdict(list)
        for r, s in sessions.items():
            if not s.never_evicts:
                groups[type(s.method)].append(r)
        if groups:  # every row's new token and position: one tensor for all, cut once
            tokens, positions = torch.tensor(token_ids)[:, None].unbind(0), new_positions.unbind(0)
        for cls, members in groups.items():
            start = self.engine.mark()
            observations = [self._observation(r, sessions[r], positions[r], tokens[r]) for r in members]
            # what a method posts waits for the next read where this step's eviction protects the new
            # tokens (a recent window): their own scores are not ranked before then
            later = all(sessions[r].protocol.recent_for(sessions[r].budget) >= 1 for r in members)
            with self.reads.active() if later else nullcontext():
                if len(members) == 1:
                    sessions[members[0]].method.observe(observations[0])
                else:
                    cls.observe_batch([sessions[r].method for r in members], observations)
            end = self.engine.mark()
            for r in members:
                sessions[r].method_time.add(start, end, 1 / len(members))

    def _observation(self, r: int, s: S, new_positions: torch.Tensor, token: torch.Tensor) -> Observation:
        needs = s.method.needs
        recorded = (
            self.recorder.row(r, needs.queries, needs.new_keys_values, needs.attention)
            if self.recorder is not None
            else {}
        )
        return Observation(
            phase="decode",
            new_positions=new_positions,
            new_token_ids=token,
            cache_positions=s.cache.positions,  # immutable: an eviction makes new bookkeeping
            hidden_states=RowHidden(self.hidden, r, s.hidden_layers) if s.hidden_layers else None,
            **recorded,
        )

    def _evict(self, sessions: dict[int, S]) -> None:
        groups: dict[type, list[int]] = defaultdict(list)
        for r, s in sessions.items():
            if s.over_budget("decode"):
                groups[type(s.method)].append(r)
        if groups:
            with self.reads.active():
                self._evict_groups(sessions, groups)

    def _evict_groups(self, sessions: dict[int, S], groups: dict[type, list[int]]) -> None:
        for cls, members in groups.items():
            group = [sessions[r] for r in members]
            start = self.engine.mark()
            views = [s.cache.view(s.budget, "decode", s.next_position - 1) for s in group]
            if len(group) == 1:
                scores = [group[0].method.score(views[0])]
            else:
                scores = cls.score_batch([s.method for s in group], BatchCacheView(views, self._padded(members, views)))
            scoring = (start, self.engine.mark(), 1 / len(members))
            if self._evict_together(group, members, scores, scoring):
                continue
            for s, score in zip(group, scores):
                s.apply_scores(score, scoring)

    def _evict_together(self, group: list[S], members: list[int], scores, scoring: tuple) -> bool:
        """Evict rows ``members`` of the slabs in one selection and one gather
        (``cache_rows.evict_rows``) when their sessions share a protocol and slot contract (budgets and
        lengths may differ); False when they cannot (nothing changed: each evicts alone)."""
        s0 = group[0]
        if not self.shared or any(
            s.protocol != s0.protocol or (s.ordered_slots, s.keeps_fewer) != (s0.ordered_slots, s0.keeps_fewer)
            for s in group
        ):
            return False
        start = self.engine.mark()
        dropped = evict_rows(
            [s.cache for s in group],
            scores,
            [s.budget for s in group],
            s0.protocol,
            [s.next_position - 1 for s in group],
            s0.ordered_slots,
            self.kv,
            members,
            keeps_fewer=s0.keeps_fewer,
        )
        if dropped is None:
            return False
        selection = (start, self.engine.mark(), 1 / len(group))
        for s, n in zip(group, dropped):
            s.book_eviction(n, scoring, selection)
        return True

    def _padded(self, members: list[int], views):
        """Builder of ``BatchCacheView.keys`` / ``values`` for slab rows ``members``."""

        def build(which: int) -> torch.Tensor:  # 0: keys, 1: values; [L, n, H, longest, d]
            longest = max(v.length for v in views)
            contiguous = members == list(range(members[0], members[0] + len(members)))
            slab = self.kv[:, which, :, :, :longest]
            return (
                slab[:, members[0] : members[-1] + 1]
                if contiguous
                else slab.index_select(1, to_device(members, self.device))
            )

        return build


def suppressed(logits: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
    """``logits`` with ``settings.suppress``'s tokens at -inf (never chosen)."""
    if not settings.suppress:
        return logits
    return logits.index_fill(-1, to_device(settings.suppress, logits.device), float("-inf"))
