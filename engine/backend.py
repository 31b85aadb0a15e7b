"""The backend seam: everything the engine asks of a model runtime, behind one class.

The engine's loops (``session.py``, ``decode.py``) and everything above the engine (fidelity, signal
studies, the cell worker, the benchmarks) reach the model only through a backend: load facts,
forward a step with explicit positions, the observations a method's ``Needs`` ask for (hidden
states through hooks, queries / keys / attention rows through ``probe.py``), the KV store that
gathers and compacts kept slots (``cache.py``), whole-sequence passes for references and analyses,
and what it is (for provenance). :class:`HFBackend`, Hugging Face's eager forward over a
``DynamicCache``, is the first implementation; a backend with its own KV layout (fixed slabs,
CUDA graphs) implements the same methods.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from kvleague.engine.batch_invariance import pad_linear_rows
from kvleague.engine.cache import BudgetedCache
from kvleague.engine.cache_layers import held
from kvleague.engine.decode import BatchSlabLayer
from kvleague.engine.probe import wrapper_name


class HFBackend:
    """A Hugging Face causal LM run by its own forward pass, observed through hooks and the probing
    attention wrappers, its KV cache a ``DynamicCache`` of slab layers (:class:`BudgetedCache`)."""

    name = "hf"
    #: a batch keeps its finished rows as padding (``DecodeLoop._retire``): only a backend that
    #: captures steps per batch size wants that; this one drops them at once
    pads_finished_rows = False
    #: evict methods whose scores are order-free (``Needs.order_free_scores``) by filling holes, not
    #: in position order: this backend keeps the order, bit for bit with the methods' references
    reorders_slots = False

    def __init__(self, model, tokenizer, attn_implementation: str = "sdpa"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.attn_implementation = attn_implementation
        config = model.config
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.intermediate_size = getattr(config, "intermediate_size", 4 * config.hidden_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.layers = model.get_decoder().layers
        self.eos_ids = {
            e
            for e in {tokenizer.eos_token_id, *_as_list(getattr(model.generation_config, "eos_token_id", None))}
            if e is not None
        }
        model.set_attn_implementation(wrapper_name(attn_implementation))
        if self.device.type == "cpu":  # a row's bits independent of its batch (engine/batch_invariance.py)
            pad_linear_rows(model)
        if self.device.type == "cuda":
            # SDPA's cuDNN kernel plans per shape, and the cache meets a new length at every decode step
            # (the first pass over new lengths ran at 0.17x the second on an H200, docs/gpu.md); the
            # flash and memory-efficient kernels need no plan
            torch.backends.cuda.enable_cudnn_sdp(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype  # read live: tests convert a loaded model to float64

    # -- what it is ---------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Provenance: the backend, the checkpoint's Hub commit (None for a local directory), size, dtype, device."""
        return {
            "backend": self.name,
            "model_revision": getattr(self.model.config, "_commit_hash", None),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "model_type": self.model.config.model_type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }

    # -- the KV store and one forward pass ------------------------------------------------------------

    def new_cache(self, reserve: int) -> BudgetedCache:
        """An empty KV store whose slabs hold ``reserve`` slots before they grow."""
        return BudgetedCache(self.model.config, self.n_layers, self.n_kv_heads, self.device, reserve=reserve)

    def take_slab(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Zeroed slabs for a batch (``decode.py``); a backend that captures steps reuses them."""
        return like.new_zeros(shape)

    def give_slab(self, slab: torch.Tensor, tenants=()) -> None:
        """A batch is done with ``slab`` (``tenants``: sequences that may still be bound to its rows)."""

    def empty_batch_cache(self):
        """A cache object to hang batched slab layers on (``decode.py``)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def batch_layer(self, keys: torch.Tensor, values: torch.Tensor, rows) -> BatchSlabLayer:
        """One layer of the batched cache over slabs ``keys`` / ``values`` ``[N, H, capacity, d]`` (``decode.py``)."""
        return BatchSlabLayer(keys, values, rows)

    def forward(
        self,
        token_ids: torch.Tensor,
        rope_positions: torch.Tensor,
        cache,
        start_slot: int,
        attention_mask: torch.Tensor | None = None,
        decode: bool = False,
    ) -> torch.Tensor:
        """Run ``token_ids`` ``[N, C]`` with RoPE positions ``rope_positions`` ``[N, C]`` over ``cache`` (its
        raw cache object), writing at storage slots ``start_slot`` .. ``start_slot + C - 1`` (so the causal
        mask is right for a shrunken cache); ``attention_mask`` ``[N, S]`` hides padded slots. Returns
        the last position's logits ``[N, V]``. ``decode``: a decode loop's step (not a fed prompt or
        turn, even of one token), which a backend may capture."""
        return self.model_step(token_ids, rope_positions, cache, start_slot, attention_mask)

    def model_step(
        self,
        token_ids: torch.Tensor,
        rope_positions: torch.Tensor,
        cache,
        start_slot: int,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The model's own forward over ``cache`` at storage slots from ``start_slot``, under the mask
        given (a backend with its own KV layout builds a different one): the last position's logits."""
        out = self.model(
            input_ids=token_ids,
            position_ids=rope_positions,
            attention_mask=attention_mask,
            cache_position=torch.arange(start_slot, start_slot + token_ids.shape[1], device=self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    @contextmanager
    def observing(self, kernel: str, hidden_layers: list[int], on_hidden) -> Iterator[None]:
        """Run under attention ``kernel`` with ``on_hidden(layer, output)`` called by each listed layer
        (index ``n_layers``: the final norm's output, HF's last hidden state); the kernel in force before
        is restored on exit."""
        model = self.model
        with ExitStack() as stack:
            previous = model.config._attn_implementation  # nested uses restore what the outer one set
            if previous != wrapper_name(kernel):
                model.set_attn_implementation(wrapper_name(kernel))
                stack.callback(model.set_attn_implementation, previous)
            for layer in hidden_layers:
                module = self.layers[layer] if layer < self.n_layers else model.get_decoder().norm
                hook = (
                    lambda l: (
                        lambda module, args, output: on_hidden(l, output[0] if isinstance(output, tuple) else output)
                    )
                )(layer)
                stack.callback(module.register_forward_hook(hook).remove)
            yield

    # -- whole-sequence passes (references and analyses) ---------------------------------------------

    def sequence_logits(self, ids: list[int], predicting: list[int]) -> torch.Tensor:
        """Logits ``[len(predicting), V]`` at positions ``predicting`` of one full-cache pass over ``ids``."""
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(predicting, device=self.device),
        )
        return out.logits[0]

    def analysis_pass(self, ids: list[int], keep: int) -> Analysis:
        """One eager pass over ``ids``: every layer's hidden states and attention weights, the cache it
        leaves (reusable as a prefix), and the last ``keep`` positions' logits."""
        from transformers import DynamicCache

        with self.observing("eager", [], None):
            cache = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                output_attentions=True,
                logits_to_keep=keep,
            )
        return Analysis(
            logits=out.logits[0],
            hidden_states=[h[0] for h in out.hidden_states],
            attentions=[a[0] for a in out.attentions],
            keys=[held(layer.keys)[0] for layer in cache.layers],
            values=[held(layer.values)[0] for layer in cache.layers],
            prefix=Prefix(self, cache),
        )

    def empty_prefix(self) -> Prefix:
        from transformers import DynamicCache

        return Prefix(self, DynamicCache(config=self.model.config))


class Prefix:
    """A full cache of a sequence's first tokens that continuations start from (signal studies)."""

    def __init__(self, backend: HFBackend, cache):
        self.backend, self.cache = backend, cache

    def continue_with(self, start: int, ids: list[int], keep: int) -> tuple[torch.Tensor, Prefix]:
        """Logits of the last ``keep`` positions of ``ids`` when ``ids[start:]`` follows this cache cut to
        ``start`` tokens (a copy: this prefix is unchanged), and the continued cache."""
        prefix = copy.deepcopy(self.cache)
        prefix.crop(start)
        out = self.backend.model(
            input_ids=torch.tensor([ids[start:]], device=self.backend.device),
            past_key_values=prefix,
            use_cache=True,
            logits_to_keep=keep,
        )
        return out.logits[0], Prefix(self.backend, prefix)

    def step(self, token: int) -> torch.Tensor:
        """Append one token (in place); the logits ``[V]`` that follow it."""
        out = self.backend.model(
            input_ids=torch.tensor([[token]], device=self.backend.device), past_key_values=self.cache, use_cache=True
        )
        return out.logits[0, -1]


class Analysis:
    """What :meth:`HFBackend.analysis_pass` returns; per-layer tensors without the batch dimension."""

    def __init__(self, logits, hidden_states, attentions, keys, values, prefix: Prefix):
        #: ``[keep, V]``
        self.logits = logits
        #: ``n_layers + 1`` tensors ``[T, hidden]`` (HF's ``hidden_states``: the embeddings first)
        self.hidden_states = hidden_states
        #: per layer ``[H_q, T, T]``
        self.attentions = attentions
        #: per layer ``[H_kv, T, d]`` (post-RoPE keys, as cached)
        self.keys = keys
        self.values = values
        self.prefix = prefix


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
