"""Batching policy: which sequences decode together, and how many fit.

``Engine.generate_batch`` (:func:`generate_batch`) is ``Engine.generate`` for a list of prompts, and
:func:`teacher_force_batch` the batched ``Session.teacher_force`` that fidelity uses. Prefill is per
sequence (``Session.feed``: chunked prefill and prefill-time eviction; a prompt chunk is already a
matrix product, so batching it buys little); decoding runs the one decode loop
(``runner/engine/decode.py``) over up to ``batch_size`` sequences, each exactly as it would alone.
Sequences whose methods need eager attention (``Needs.eager``) and the others run as separate
batches, so each runs under the kernel it would use alone.

Multi-turn (agentic) episodes stay at batch 1 (``Engine.session``): each turn's length depends on
the previous turn's tool output, so the sequences of a batch would wait on each other's tools and a
batch would be as slow as its slowest episode at every turn.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from kvleague.runner.engine.contract import EvictionMethod
from kvleague.runner.engine.decode import DecodeLoop
from kvleague.runner.engine.errors import KvleagueError
from kvleague.runner.engine.protocol import GenerationSettings, Protocol
from kvleague.runner.engine.session import GenerationResult, Session

#: the most sequences the automatic batch size puts in one batch
MAX_AUTO_BATCH = 64


def generate_batch(
    engine,
    prompts: Sequence[str | list[int]],
    methods: Sequence[EvictionMethod],
    budget: int | Sequence[int],
    protocol: Protocol | None = None,
    settings: GenerationSettings | None = None,
    seeds: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> list[GenerationResult]:
    """Generate a completion for every prompt; result i is what ``engine.generate(prompts[i],
    methods[i], budgets[i], protocol, settings, seeds[i])`` returns (same tokens and kept positions,
    up to float rounding of the batched kernels), computed ``batch_size`` sequences at a time.

    ``methods``: one instance per prompt (distinct objects: each holds its sequence's state).
    ``budget``: one for all, or one per prompt (budgets relative to each prompt, resolved by
    ``Protocol.for_prompt``). ``seeds``: one per prompt (default 0 each, as ``generate``).
    ``batch_size``: sequences decoded together; ``None`` = :func:`auto_batch_size` (what fits in memory)."""
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
            engine, [len(ids[i]) for i in members], settings.max_new_tokens, max(budgets[i] for i in members), protocol,
            never_evicts=all(methods[i].never_evicts for i in members),
        )
        for start in range(0, len(members), size):
            chunk = members[start : start + size]
            sessions = [Session(engine, methods[i], budgets[i], protocol, seeds[i]) for i in chunk]
            for session, i in zip(sessions, chunk):
                with session:
                    session.feed(ids[i])
            DecodeLoop(engine, sessions, settings).run()
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
    backend = engine.backend
    element = backend.dtype.itemsize
    longest = max(prompt_tokens)
    slots = longest + max_new_tokens if never_evicts else max(budget + protocol.buffer + 1, longest)
    kv = 2 * engine.n_layers * engine.n_kv_heads * engine.head_dim * element * slots
    activations = 4 * backend.vocab_size + 4 * element * (backend.hidden_size + backend.intermediate_size) + 4 * engine.n_heads * slots
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
