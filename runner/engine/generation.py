"""Generation under a hard KV budget, one sequence at a time (``Engine.generate_batch``, in
``runner/engine/batch.py``, decodes many such sequences together).

``Engine`` holds a loaded HF causal LM. ``Engine.session`` opens one sequence with one KV cache; a
session can be fed and decoded repeatedly (multi-turn episodes keep the same cache, so an eviction
in turn 1 affects turn 5). ``Engine.generate`` is feed-then-decode for a single prompt.

Each forward pass: the new tokens go in with explicit ``position_ids`` (true positions, or
cache-length positions under ``positions: compact``) and ``cache_position`` in storage coordinates
(so the causal mask is right for a shrunken cache); the method observes what it declared in
``Needs``; then, when the cadence says so, the method scores the cache and the engine keeps the best
slots among the evictable ones, moving the cache entries in place (``runner/engine/cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from runner.engine.contract import EvictionMethod, Observation, SequenceInfo
from runner.engine.probe import AttentionRecorder, recording, wrapper_name
from runner.engine.cache import BudgetedCache
from runner.engine.errors import KvleagueError
from runner.engine.protocol import GenerationSettings, Protocol
from runner.engine.resources import PeakMemory, device_clock

@dataclass
class DecodeOutput:
    token_ids: list[int]
    text: str
    stop_reason: str  # "eos" | "stop" | "length"


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
        from dataclasses import asdict

        return asdict(self)


class Engine:
    def __init__(self, model, tokenizer, attn_implementation: str = "sdpa"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.attn_implementation = attn_implementation
        config = model.config
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.device = next(model.parameters()).device
        self.layers = model.get_decoder().layers
        #: the clock of every timing the engine reports (synchronizes the device first)
        self.clock = device_clock(self.device)
        if self.device.type == "cuda":
            # SDPA's cuDNN kernel plans per shape, and the cache meets a new length at every decode step
            # (the first pass over new lengths ran at 0.14x the second on an H200); the flash and
            # memory-efficient kernels need no plan
            torch.backends.cuda.enable_cudnn_sdp(False)
        eos = {tokenizer.eos_token_id, *_as_list(getattr(model.generation_config, "eos_token_id", None))}
        self.eos_ids = {e for e in eos if e is not None}
        model.set_attn_implementation(wrapper_name(attn_implementation))

    def session(self, method: EvictionMethod, budget: int, protocol: Protocol | None = None, seed: int = 0) -> "Session":
        return Session(self, method, budget, protocol or Protocol(), seed)

    def generate(
        self,
        prompt: str | list[int],
        method: EvictionMethod,
        budget: int,
        protocol: Protocol | None = None,
        settings: GenerationSettings | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        with self.session(method, budget, protocol, seed) as session:
            session.feed(ids)
            session.decode(settings or GenerationSettings())
            return session.result()


    def generate_batch(
        self,
        prompts: list[str | list[int]],
        methods: list[EvictionMethod],
        budget: int,
        protocol: Protocol | None = None,
        settings: GenerationSettings | None = None,
        seeds: list[int] | None = None,
        batch_size: int | None = None,
    ) -> list[GenerationResult]:
        """:meth:`generate` for many prompts, decoded ``batch_size`` at a time (``None``: what fits in
        memory). ``methods[i]`` is prompt i's own instance, ``seeds[i]`` its seed (default 0).
        Result i equals ``generate(prompts[i], methods[i], budget, protocol, settings, seeds[i])`` in
        tokens and kept positions; see ``runner/engine/batch.py``."""
        from runner.engine.batch import generate_batch

        return generate_batch(self, prompts, methods, budget, protocol, settings, seeds, batch_size)


class Session:
    """One sequence on one KV cache. Use as a context manager (it installs and removes hooks)."""

    def __init__(self, engine: Engine, method: EvictionMethod, budget: int, protocol: Protocol, seed: int):
        protocol.check_budget(budget)
        self.engine, self.method, self.budget, self.protocol, self.seed = engine, method, budget, protocol, seed
        needs = method.needs
        self.attn_implementation = "eager" if needs.eager else engine.attn_implementation
        # slabs sized for the budget plus the most one forward pass appends before an eviction
        per_pass = max(protocol.buffer + 1, protocol.prefill_chunk or 1)
        self.cache = BudgetedCache(
            engine.model.config, engine.n_layers, engine.n_kv_heads, engine.device, reserve=budget + per_pass
        )
        self.ordered_slots = needs.ordered_slots
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
            )
            if wants_probe
            else None
        )
        self.hidden: dict[int, torch.Tensor] = {}
        self.next_position = 0  # absolute position of the next token
        self.pending: list[int] = []  # generated tokens not yet fed through the model
        self.logits: torch.Tensor | None = None
        self.generated: list[int] = []
        self.outputs: list[DecodeOutput] = []
        self.prompt_tokens = 0
        self.prefill_seconds = 0.0
        self.step_seconds: list[float] = []
        self.method_seconds = 0.0
        self.selection_seconds = 0.0
        self.evictions = 0
        self.evicted_tokens = 0
        self.peak_entries = 0
        self.peak_kv_bytes = 0
        self.memory = PeakMemory(engine.device)
        self._stack = ExitStack()
        method.reset(
            SequenceInfo(
                n_layers=engine.n_layers,
                n_heads=engine.n_heads,
                n_kv_heads=engine.n_kv_heads,
                head_dim=engine.head_dim,
                hidden_size=engine.model.config.hidden_size,
                budget=budget,
                seed=seed,
                device=engine.device,
                dtype=engine.model.dtype,
            )
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Session":
        model = self.engine.model
        if self.attn_implementation != self.engine.attn_implementation:
            model.set_attn_implementation(wrapper_name(self.attn_implementation))
            self._stack.callback(model.set_attn_implementation, wrapper_name(self.engine.attn_implementation))
        for layer in self.hidden_layers:  # index n_layers: the final norm's output (HF hidden_states[-1])
            module = self.engine.layers[layer] if layer < self.engine.n_layers else model.get_decoder().norm
            handle = module.register_forward_hook(self._hidden_hook(layer))
            self._stack.callback(handle.remove)
        self._stack.enter_context(recording(self.recorder))
        self._stack.enter_context(torch.inference_mode())
        self.memory.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _hidden_hook(self, layer: int):
        def hook(module, args, output):
            self.hidden[layer] = (output[0] if isinstance(output, tuple) else output)[0]

        return hook

    # -- feeding and decoding ------------------------------------------------------------------

    def feed(self, token_ids: list[int]) -> None:
        """Append prompt (or tool-observation) tokens, compressing after each prefill chunk."""
        if not token_ids:
            raise KvleagueError("prompt: empty token list")
        start = self.engine.clock()
        self._flush_pending()
        chunk = self.protocol.prefill_chunk or len(token_ids)
        for i in range(0, len(token_ids), chunk):
            self._forward(token_ids[i : i + chunk], prompt=True, phase="prefill")
            if self.cache.length > self.budget:
                self._evict("prefill")
        self.prompt_tokens += len(token_ids)
        self.prefill_seconds += self.engine.clock() - start

    def decode(self, settings: GenerationSettings, on_token: Callable[[int], None] | None = None) -> DecodeOutput:
        """Generate until EOS, a stop string or ``max_new_tokens``; ``on_token`` sees each token as it
        is chosen (streaming output, progress)."""
        if self.logits is None:
            raise KvleagueError("decode: feed a prompt first")
        self._flush_pending()
        tokens: list[int] = []
        window = 4 * max((len(s) for s in settings.stop), default=0) + 8
        reason = "length"
        tokenizer = self.engine.tokenizer
        while True:
            step_start = self.engine.clock()
            token = self._next_token(self.logits, settings)
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in self.engine.eos_ids:
                reason = "eos"
            elif settings.stop and any(s in tokenizer.decode(tokens[-window:]) for s in settings.stop):
                reason = "stop"
            if reason != "length" or len(tokens) >= settings.max_new_tokens:
                self.pending = [token]
                self.step_seconds.append(self.engine.clock() - step_start)
                break
            self._forward([token], prompt=False, phase="decode")
            if self.cache.length > self.budget + self.protocol.buffer:
                self._evict("decode")
            self.step_seconds.append(self.engine.clock() - step_start)
        self.generated.extend(tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if reason == "stop":  # the completion ends before the first stop string, which it excludes
            text = text[: min(text.find(s) for s in settings.stop if s in text)]
        output = DecodeOutput(tokens, text, reason)
        self.outputs.append(output)
        return output

    def teacher_force(self, token_ids: list[int], on_logits: Callable[[torch.Tensor, int], None]) -> None:
        """Append ``token_ids`` as if this session had decoded them: ``on_logits(logits, token)`` sees
        the distribution the model predicts each token from, and the method observes and evicts at
        exactly the points :meth:`decode` would (the last token stays pending, as a decoded one does)."""
        if self.logits is None:
            raise KvleagueError("teacher_force: feed a prompt first")
        if not token_ids:
            return
        self._flush_pending()
        for i, token in enumerate(token_ids):
            step_start = self.engine.clock()
            on_logits(self.logits, token)
            if i == len(token_ids) - 1:
                self.pending = [token]
            else:
                self._forward([token], prompt=False, phase="decode")
                if self.cache.length > self.budget + self.protocol.buffer:
                    self._evict("decode")
            self.step_seconds.append(self.engine.clock() - step_start)
        self.generated.extend(token_ids)

    def _flush_pending(self) -> None:
        """Feed the previous decode's last token, which sampling produced but no forward pass saw."""
        if self.pending:
            self._forward(self.pending, prompt=False, phase="decode")
            self.pending = []
            if self.cache.length > self.budget + self.protocol.buffer:
                self._evict("decode")

    def _next_token(self, logits: torch.Tensor, settings: GenerationSettings) -> int:
        if settings.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
        if settings.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= settings.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _forward(self, token_ids: list[int], prompt: bool, phase: str) -> None:
        engine, cache = self.engine, self.cache
        c = len(token_ids)
        length = cache.length
        positions = torch.arange(self.next_position, self.next_position + c, device=engine.device)
        rope = positions if self.protocol.positions == "absolute" else torch.arange(length, length + c, device=engine.device)
        if self.recorder is not None:
            self.recorder.start(c)
        out = engine.model(
            input_ids=torch.tensor([token_ids], device=engine.device),
            position_ids=rope[None],
            cache_position=torch.arange(length, length + c, device=engine.device),
            past_key_values=cache.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.logits = out.logits[0, -1]
        cache.track(positions, prompt)
        self.next_position += c
        self.peak_entries = max(self.peak_entries, cache.length)
        self.peak_kv_bytes = max(self.peak_kv_bytes, cache.kv_bytes())
        self.memory.sample()
        if self.method.never_evicts:
            return
        start = self.engine.clock()
        rec = self.recorder
        self.method.observe(
            Observation(
                phase=phase,
                new_positions=positions,
                new_token_ids=torch.tensor(token_ids),
                cache_positions=list(cache.positions),  # eviction rebinds entries of the live list
                hidden_states={layer: self.hidden[layer] for layer in self.hidden_layers} if self.hidden_layers else None,
                new_keys=rec.k_new if rec and rec.new_keys_values else None,
                new_values=rec.v_new if rec and rec.new_keys_values else None,
                queries=rec.q if rec and rec.queries else None,
                attention=rec.rows if rec and rec.attention else None,
            )
        )
        self.method_seconds += self.engine.clock() - start

    def _evict(self, phase: str) -> None:
        if self.method.never_evicts:
            return
        start = self.engine.clock()
        current = self.next_position - 1
        scores = self.method.score(self.cache.view(self.budget, phase, current))
        selection = self.engine.clock()
        self.evicted_tokens += self.cache.evict(scores, self.budget, self.protocol, current, ordered=self.ordered_slots)
        self.evictions += 1
        end = self.engine.clock()
        self.method_seconds += end - start
        self.selection_seconds += end - selection

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


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
