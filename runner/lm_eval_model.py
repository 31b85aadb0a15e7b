"""kvleague as an lm-eval model: generation under a KV budget with any registered eviction method.

lm-eval (0.4.x) has no plugin discovery for models, so the model is registered when this module is
imported. Three ways to use it:

* the command line, with exactly the ``lm_eval`` arguments (``runner/lm_eval_cli.py``)::

      kvleague-lm-eval run --model kvleague \\
          --model_args pretrained=DIR,method=streaming_llm,budget=1024,method.n_sink=4 --tasks gsm8k

* Python: ``import kvleague.runner.lm_eval_model`` then ``lm_eval.simple_evaluate(model="kvleague", ...)``;
* any script that imports ``kvleague.runner.lm_eval_model`` before calling lm-eval's CLI.

``--model_args`` keys: ``pretrained`` (a known name such as ``smollm2-135m``, a ``.gguf`` file, a
checkpoint dir or a Hub id; see ``runner/models/source.py``), ``method`` (a kvleague method,
default ``full``), ``budget`` (default 1024), method hyperparameters as ``method.NAME=VALUE``, the
protocol (every field of ``engine.protocol.Protocol``: ``cadence``, ``positions``, ``sink``,
``recent``, ``protect_prompt``, ``prefill_chunk``, ``recent_max_fraction``, ``prompt_over_budget``),
``dtype``, ``device``, ``attn_implementation``, ``seed``, ``max_gen_toks`` (default when a task sets
none) and ``add_special_tokens`` (how plain contexts are tokenized; default: the tokenizer's
default). Every request runs on a fresh session (its own KV cache, a fresh method instance).

lm-eval's ``--batch_size`` is honoured: requests with the same generation kwargs decode together
(``Engine.generate_batch``; each exactly as alone, up to float rounding of the batched kernels), N at
a time, or under ``auto`` (``auto:K`` too) as many as fit in memory, at most ``--max_batch_size``;
a request that finishes gives its row to the next one waiting (continuous batching).

Only ``generate_until`` is supported: kvleague measures what eviction does to generation, and a
log-likelihood pass over a given continuation never evicts anything worth measuring.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its lazy import skips a non-empty registry)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvleague.engine.errors import KvleagueError
from kvleague.engine.protocol import Protocol, parse_bool, parse_optional, protocol_fields

log = logging.getLogger(__name__)

MODEL_NAME = "kvleague"
_KNOWN_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p"}
_NOT_SUPPORTED = (
    "kvleague (lm-eval model 'kvleague') supports only generate_until tasks: it measures generation under "
    "a KV-cache budget; choose a generate_until task (e.g. gsm8k) or use --model hf for log-likelihood tasks"
)


def _device(device: str | None) -> str:
    """kvleague's ``auto`` unless a device is named (``kvleague-lm-eval`` passes ``auto`` where lm-eval's
    default would be ``cuda:0``); a named CUDA device without CUDA falls back to the CPU, as lm-eval's own
    HF model does, with a warning: it was asked for."""
    if not device:
        return "auto"
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            log.warning("kvleague: device %s requested but CUDA is not available; using the CPU", device)
            return "cpu"
    return str(device)


class KvleagueLM(LM):
    """An lm-eval ``LM`` whose ``generate_until`` runs kvleague's engine with an eviction method."""

    def __init__(
        self,
        pretrained: Any = None,
        method: str = "full",
        budget: int = 1024,
        dtype: str = "auto",
        device: str | None = "auto",
        attn_implementation: str = "sdpa",
        seed: int = 0,
        max_gen_toks: int = 256,
        add_special_tokens: Any = None,
        batch_size: Any = 1,
        max_batch_size: Any = 64,
        engine: Any = None,
        **extra: Any,
    ) -> None:
        super().__init__()
        from kvleague.methods.registry import build_method

        protocol_keys = [f.name for f in protocol_fields()]
        params: dict[str, Any] = {}
        protocol: dict[str, Any] = {}
        for key, value in extra.items():
            if key.startswith("method."):
                params[key[len("method.") :]] = value
            elif key in protocol_keys:
                protocol[key] = value
            else:
                allowed = (
                    "pretrained, method, budget, method.<hyperparameter>, "
                    + ", ".join(protocol_keys)
                    + (", dtype, device, attn_implementation, seed, max_gen_toks, add_special_tokens")
                )
                raise KvleagueError(f"model_args: unknown key {key!r}; allowed: {allowed}")
        self.method_name = str(method)
        self.method_params = params
        build_method(self.method_name, params)  # validate names and values now, not mid-run
        self.budget = int(budget)
        self.protocol = Protocol.from_text(protocol)
        self.protocol.check_budget(self.budget)
        self.seed = int(seed)
        self.batch_size, self.max_batch_size = _batch_size(batch_size), _positive("max_batch_size", max_batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.add_special_tokens = parse_optional(parse_bool)(add_special_tokens)
        if engine is None:
            if pretrained is None:
                raise KvleagueError(
                    "model_args: pretrained is required (a known name such as smollm2-135m, a .gguf file, "
                    "a checkpoint directory or a Hub id)"
                )
            from kvleague.runner.models import load_engine

            engine = load_engine(
                str(pretrained), attn_implementation=attn_implementation, dtype=dtype, device=_device(device)
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._device = engine.device
        self._templated = False  # set once lm-eval asks us to apply the chat template
        #: per request, in order: the engine's instrumentation (kept positions dropped)
        self.generations: list[dict[str, Any]] = []
        self._warned: set[str] = set()

    # -- lm-eval API ---------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(_NOT_SUPPORTED)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(_NOT_SUPPORTED)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's completion, in order; requests with the same generation settings decode
        together (``batch_size`` at a time; None: what fits in memory, at most ``max_batch_size``)."""
        args = [(r.args[0], r.args[1] if len(r.args) > 1 else {}) for r in requests]
        groups: dict[Any, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(self.settings(gen_kwargs), []).append(i)
        outputs: list[str | None] = [None] * len(args)
        records: list[dict | None] = [None] * len(args)
        with tqdm(total=len(args), disable=disable_tqdm or self.rank != 0, desc="kvleague generate_until") as bar:
            for settings, members in groups.items():

                def finished(j: int, result, members=members) -> None:  # as each request's decode ends
                    i = members[j]
                    outputs[i], records[i] = result.completion, result.to_dict()
                    records[i].pop("kept_positions", None)
                    self.cache_hook.add_partial("generate_until", args[i], outputs[i])
                    bar.update(1)

                self._generate([args[i][0] for i in members], settings, finished)
        assert all(o is not None for o in outputs)  # every request's decode ended
        self.generations.extend(cast("list[dict]", records))
        return cast("list[str]", outputs)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        self._templated = True
        kwargs = {
            "tokenize": False,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": not add_generation_prompt,
        }
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except Exception:
            if not chat_history or chat_history[0].get("role") != "system":
                raise
            # templates without a system role: fold it into the first user message
            system, rest = chat_history[0]["content"], [dict(m) for m in chat_history[1:]]
            if rest and rest[0].get("role") == "user":
                rest[0]["content"] = f"{system}\n\n{rest[0]['content']}"
            return self.tokenizer.apply_chat_template(rest, **kwargs)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kvleague")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if isinstance(chat_template, str):
            return chat_template
        return getattr(self.tokenizer, "chat_template", None) or ""

    def get_model_info(self) -> dict[str, Any]:
        return {
            "kvleague_method": self.method_name,
            "kvleague_method_params": dict(self.method_params),
            "kvleague_budget": self.budget,
            "kvleague_protocol": self.protocol.model_dump(mode="json"),
            "kvleague_seed": self.seed,
        }

    # -- one request ---------------------------------------------------------------------------------
    def settings(self, gen_kwargs: dict[str, Any] | None):
        """lm-eval generation kwargs -> kvleague ``GenerationSettings``."""
        from kvleague.engine.protocol import GenerationSettings

        kwargs = dict(gen_kwargs or {})
        until = kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        do_sample = parse_bool(kwargs.get("do_sample", False))
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if not do_sample:
            temperature = 0.0
        elif temperature == 0.0:
            temperature = 1.0
        for key in sorted(set(kwargs) - _KNOWN_GEN_KWARGS):
            if key not in self._warned:
                self._warned.add(key)
                log.warning("kvleague: generation kwarg %r is not supported and is ignored", key)
        return GenerationSettings(
            max_new_tokens=int(kwargs.get("max_gen_toks") or self.max_gen_toks),
            temperature=temperature,
            top_p=float(kwargs.get("top_p", 1.0) or 1.0) if do_sample else 1.0,
            stop=tuple(s for s in until if s),
        )

    def encode(self, context: str) -> list[int]:
        if self._templated:  # the template's text already carries BOS and friends
            add = False
        else:
            add = True if self.add_special_tokens is None else self.add_special_tokens
        return [int(i) for i in self.tokenizer(context, add_special_tokens=add)["input_ids"]]

    def _generate(self, contexts: list[str], settings, on_result=None) -> list:
        """The engine's results for ``contexts``, decoded ``batch_size`` at a time, each finished row
        taken by the next context: each a fresh method instance (per-sequence state), its own budget
        (``budget_base: prompt``: room on top of its prompt); ``on_result(j, result)`` as context j ends."""
        from kvleague.methods.registry import build_method

        ids = [self.encode(context) for context in contexts]
        protocol, budgets = self.protocol.for_prompts(self.budget, [len(each) for each in ids])
        methods = [build_method(self.method_name, self.method_params) for _ in ids]
        return self.engine.generate_batch(
            ids,
            methods,
            budgets,
            protocol,
            settings,
            [self.seed] * len(ids),
            self.batch_size,
            on_result,
            self.max_batch_size,
        )


def _positive(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool):
        raise KvleagueError(f"{name}: got {value!r}; allowed: a positive integer")
    return number


def _batch_size(value: Any) -> int | None:
    """lm-eval's ``--batch_size``: a positive integer, or ``auto`` / ``auto:K`` (None: what fits in
    memory; lm-eval's K, how often it re-measures, means nothing here)."""
    if value is None or str(value).startswith("auto"):
        return None
    try:
        return _positive("batch_size", value)
    except KvleagueError:
        raise KvleagueError(f"batch_size: got {value!r}; allowed: auto, auto:K or a positive integer") from None


register_model(MODEL_NAME)(KvleagueLM)
