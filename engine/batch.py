"""Batching policy: which sequences decode together, and how many fit.

``Engine.generate_batch`` (:func:`generate_batch`) is ``Engine.generate`` for a list of prompts, and
:func:`teacher_force_batch` the batched ``Session.teacher_force`` that fidelity uses. Prefill is per
sequence (``Session.feed``: chunked prefill and prefill-time eviction; a prompt chunk is already a
matrix product, so batching it buys little); decoding runs the one decode loop
(``engine/decode.py``) over ``batch_size`` rows, each sequence exactly as it would run alone.
Batching is continuous: when a sequence ends (EOS, a stop string), the next prompt waiting is fed and
takes its row, so a batch is not held to its longest sequence.
Sequences whose methods need eager attention (``Needs.eager``) and the others run as separate
batches, so each runs under the kernel it would use alone.

Multi-turn (agentic) episodes decode together through :func:`drive_sessions`: each episode's own
code (a task's ``run_episode``) drives a :class:`SessionHandle` from its own thread, and the caller's
thread carries out every request, in rounds: once each live episode waits on its session, the fed
turns are prefilled one by one and the waiting decodes run as one batch. An episode that finished its
decode early waits for the round's longest; one sequence's requests keep their order, so each episode
feeds, observes and evicts exactly as alone. All tensor work stays on the caller's thread (hooks and
``inference_mode`` are per thread); episode threads only run Python (parsing, tools).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvleague.engine.contract import EvictionMethod
from kvleague.engine.decode import DecodeLoop
from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import GenerationSettings, Protocol
from kvleague.engine.session import GenerationResult, Session, prompt_parts

#: the most sequences the automatic batch size puts in one batch
MAX_AUTO_BATCH = 64


def generate_batch(
    engine,
    prompts: Sequence[str | list[int] | tuple[list[int], ...]],
    methods: Sequence[EvictionMethod],
    budget: int | Sequence[int],
    protocol: Protocol | None = None,
    settings: GenerationSettings | None = None,
    seeds: Sequence[int] | None = None,
    batch_size: int | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
    max_batch_size: int | None = None,
) -> list[GenerationResult]:
    """Generate a completion for every prompt; result i is what ``engine.generate(prompts[i],
    methods[i], budgets[i], protocol, settings, seeds[i])`` returns (same tokens and kept positions,
    up to float rounding of the batched kernels), computed ``batch_size`` sequences at a time, a
    finished sequence's row taken by the next prompt (continuous batching).

    ``methods``: one instance per prompt (distinct objects: each holds its sequence's state).
    ``budget``: one for all, or one per prompt (budgets relative to each prompt, resolved by
    ``Protocol.for_prompt``). ``seeds``: one per prompt (default 0 each, as ``generate``).
    ``batch_size``: sequences decoded together; ``None`` = :func:`auto_batch_size` (what fits in memory,
    at most ``max_batch_size``, default :data:`MAX_AUTO_BATCH`).
    ``on_result(i, result)``: called as sequence i finishes (progress, partial output)."""
    n = len(prompts)
    if len(methods) != n:
        raise KvleagueError(f"methods: {len(methods)} methods for {n} prompts; give one method instance per prompt")
    check_batch_arguments(methods, batch_size)
    seeds = [0] * n if seeds is None else list(seeds)
    if len(seeds) != n:
        raise KvleagueError(f"seeds: {len(seeds)} seeds for {n} prompts; give one seed per prompt (or none)")
    budgets = [budget] * n if isinstance(budget, int) else list(budget)
    if len(budgets) != n:
        raise KvleagueError(f"budget: {len(budgets)} budgets for {n} prompts; give one budget, or one per prompt")
    protocol = protocol or Protocol()
    settings = settings or GenerationSettings()
    tokenizer = engine.tokenizer
    parts = [prompt_parts(tokenizer, p) for p in prompts]  # a (context, question) prompt is fed in two parts
    ids = [[t for part in p for t in part] for p in parts]
    for i, p in enumerate(ids):
        if not p:
            raise KvleagueError(f"prompts: prompt {i} is an empty token list")
    results: dict[int, GenerationResult] = {}  # by prompt, as each finishes
    index: dict[int, int] = {}  # id(session) -> its prompt

    def fed(i: int) -> Session:
        session = Session(engine, methods[i], budgets[i], protocol, seeds[i])
        index[id(session)] = i
        with session:
            for part in parts[i]:
                session.feed(part)
        return session

    def done(session: Session) -> None:
        i = index.pop(id(session))
        results[i] = result = session.result()
        if on_result is not None:
            on_result(i, result)

    # one kernel per batch: the sequences run under the attention they would use alone
    groups: dict[bool, list[int]] = defaultdict(list)
    for i, m in enumerate(methods):
        groups[m.needs.eager].append(i)
    for members in groups.values():
        size = batch_size or auto_batch_size(
            engine,
            [len(ids[i]) for i in members],
            settings.max_new_tokens,
            max(budgets[i] for i in members),
            protocol,
            never_evicts=protocol.scope == "context" or all(methods[i].never_evicts for i in members),
            limit=max_batch_size or MAX_AUTO_BATCH,
        )
        if min(size, len(members)) == 1:
            for i in members:
                DecodeLoop(engine, [fed(i)], settings, on_done=done).run()
        else:  # continuous batching: a finished sequence's row goes to the next prompt waiting
            waiting = iter(members[size:])
            DecodeLoop(
                engine,
                [fed(i) for i in members[:size]],
                settings,
                on_done=done,
                refill=lambda: None if (i := next(waiting, None)) is None else fed(i),  # noqa: B023 - called before the loop moves on
            ).run()
    return [results[i] for i in range(n)]


def check_batch_arguments(methods: Sequence[EvictionMethod], batch_size: int | None) -> None:
    """What every batched entry point requires: one method instance per sequence (each holds its
    sequence's state) and a positive ``batch_size`` or ``None``."""
    if len({id(m) for m in methods}) != len(methods):
        raise KvleagueError(
            "methods: the same instance appears twice; give each sequence its own instance (it holds per-sequence state)"
        )
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
        raise KvleagueError(
            f"teacher_force_batch: {len(sessions)} sessions, {len(token_ids)} token lists and "
            f"{len(on_logits)} callbacks; give one of each per sequence"
        )
    groups: dict[bool, list[int]] = defaultdict(list)
    for i, s in enumerate(sessions):
        if s.logits is None:
            raise KvleagueError(f"teacher_force_batch: session {i} has not been fed a prompt")
        if s.pending:  # the previous decode's last token, which no forward pass has seen yet
            with s:
                s.flush_pending()
        if token_ids[i]:
            groups[s.method.needs.eager].append(i)
    for members in groups.values():
        longest = max(len(token_ids[i]) for i in members)
        scripts = [(token_ids[i], on_logits[i]) for i in members]
        DecodeLoop(engine, [sessions[i] for i in members], GenerationSettings(max_new_tokens=longest), scripts).run()


def auto_batch_size(
    engine,
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    budget: int,
    protocol: Protocol | None = None,
    never_evicts: bool = False,
    available_bytes: int | None = None,
    limit: int = MAX_AUTO_BATCH,
) -> int:
    """The largest batch whose KV cache and decode activations fit in 80% of the free memory.

    Per sequence: KV = 2 x layers x KV heads x head dim x element size per slot, over the most slots
    the sequence holds (prompt + new tokens without eviction; else max(B + buffer + 1, prompt));
    activations of one decode step: float32 logits over the vocabulary, the MLP's intermediate
    states and one attention row per query head. Free memory: ``available_bytes``, else the CUDA
    device's free memory, else the host's MemAvailable. At least 1, at most the number of prompts
    (and ``limit``)."""
    if not prompt_tokens:
        return 1
    protocol = protocol or Protocol()
    backend = engine.backend
    element = backend.dtype.itemsize
    longest = max(prompt_tokens)
    slots = longest + max_new_tokens if never_evicts else max(budget + protocol.buffer + 1, longest)
    kv = 2 * engine.n_layers * engine.n_kv_heads * engine.head_dim * element * slots
    activations = (
        4 * backend.vocab_size
        + 4 * element * (backend.hidden_size + backend.intermediate_size)
        + 4 * engine.n_heads * slots
    )
    if available_bytes is None:
        available_bytes = _free_memory(engine.device)
    fit = int(0.8 * available_bytes) // max(1, kv + activations)
    return max(1, min(fit, len(prompt_tokens), limit))


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


class SessionHandle:
    """A :class:`Session` as its driver sees it under :func:`drive_sessions`: ``feed``, ``decode`` and
    ``result`` ask the driving thread, which carries them out (decodes batched with the others)."""

    def __init__(self, index: int, requests: queue.SimpleQueue):
        self.index, self._requests, self._reply = index, requests, queue.SimpleQueue()

    def feed(self, token_ids: list[int]) -> None:
        return self._ask("feed", list(token_ids))

    def decode(self, settings: GenerationSettings, on_token: Callable[[int], None] | None = None):
        if on_token is not None:
            raise KvleagueError("decode: on_token is not available to a session decoded in a batch (drive_sessions)")
        return self._ask("decode", settings)

    def result(self) -> GenerationResult:
        return self._ask("result", None)

    def _ask(self, kind: str, argument: Any) -> Any:
        self._requests.put((self.index, kind, argument))
        failed, value = self._reply.get()
        if failed:
            raise value
        return value


class _Abandoned(Exception):
    """Raised in a driver whose batch stopped (another driver or a batched decode failed)."""


def drive_sessions(engine, sessions: Sequence[Session], drivers: Sequence[Callable[[SessionHandle], Any]]) -> list[Any]:
    """``drivers[i](handle_i)`` for every i, each in its own thread, ``handle_i`` standing for
    ``sessions[i]``; their decodes run together (see the module docstring). Returns the drivers'
    values in order. The first exception of a driver or of a batched decode is raised here, after
    every driver has stopped."""
    if len(sessions) != len(drivers):
        raise KvleagueError(
            f"drive_sessions: {len(sessions)} sessions and {len(drivers)} drivers; give one driver per session"
        )
    requests: queue.SimpleQueue = queue.SimpleQueue()
    handles = [SessionHandle(i, requests) for i in range(len(sessions))]
    values: list[Any] = [None] * len(sessions)

    def run(i: int) -> None:
        try:
            requests.put((i, "done", drivers[i](handles[i])))
        except BaseException as exc:
            requests.put((i, "failed", exc))

    threads = [
        threading.Thread(target=run, args=(i,), daemon=True, name=f"kvleague-driver-{i}") for i in range(len(sessions))
    ]
    live, waiting = set(range(len(sessions))), {}
    failure: BaseException | None = None
    for thread in threads:
        thread.start()
    try:
        while live:
            while len(waiting) < len(live):  # a round starts once every live driver waits on its session
                i, kind, argument = requests.get()
                if kind in ("done", "failed"):
                    live.discard(i)
                if kind == "failed":
                    raise argument
                if kind == "done":
                    values[i] = argument
                else:
                    waiting[i] = (kind, argument)
            replies = _carry_out(engine, sessions, waiting)
            waiting = {}
            for i, reply in replies.items():
                handles[i]._reply.put(reply)
    except BaseException as exc:
        failure = exc
        stop = (True, _Abandoned("another sequence of the batch failed"))
        for i in waiting:  # still live: each raises the stop and reports "failed"
            handles[i]._reply.put(stop)
        while live:  # the others stop at their next request (each ends with one "done" or "failed")
            i, kind, _ = requests.get()
            if kind in ("done", "failed"):
                live.discard(i)
            else:
                handles[i]._reply.put(stop)
    for thread in threads:
        thread.join()
    if failure is not None:
        raise failure
    return values


def _carry_out(engine, sessions: Sequence[Session], waiting: dict[int, tuple[str, Any]]) -> dict[int, tuple[bool, Any]]:
    """One round: each fed turn prefilled alone, results read, then the waiting decodes together,
    one batch per (settings, attention kernel). A request's own error goes back to its driver."""
    replies: dict[int, tuple[bool, Any]] = {}
    decodes: dict[tuple, list[int]] = defaultdict(list)
    for i, (kind, argument) in sorted(waiting.items()):
        session = sessions[i]
        try:
            if kind == "feed":
                with session:
                    session.feed(argument)
                replies[i] = (False, None)
            elif kind == "result":
                replies[i] = (False, session.result())
            elif session.logits is None:
                raise KvleagueError("decode: feed a prompt first")
            else:
                decodes[(argument, session.method.needs.eager)].append(i)
        except Exception as exc:
            replies[i] = (True, exc)
    for (settings, _), members in decodes.items():
        group = [sessions[i] for i in members]
        for session in group:
            if session.pending:  # the previous decode's last token, which no forward pass has seen yet
                with session:
                    session.flush_pending()
        DecodeLoop(engine, group, settings).run()
        for i, session in zip(members, group):
            replies[i] = (False, session.outputs[-1])
    return replies
