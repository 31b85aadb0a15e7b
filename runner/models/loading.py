"""Loading a model spec into an :class:`~engine.Engine`.

The one path for tiny test models and real ones: the spec is resolved to a local checkpoint
(``runner.models.source``), then loaded with the requested dtype, device and attention kernel.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvleague.engine import Engine, check_backend
from kvleague.engine.errors import KvleagueError, first_line
from kvleague.engine.probe import INNER_IMPLEMENTATIONS
from kvleague.runner.models.source import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_engine(
    model: str,
    *,
    attn_implementation: str = "sdpa",
    dtype: str = "auto",
    device: str = "auto",
    backend: str = "hf",
) -> Engine:
    """Load a model spec (a known name, a ``.gguf`` file, a checkpoint directory or a Hub id; see
    ``runner.models.source``) through the same path for tiny test models and real ones, on ``backend``
    (``BACKENDS``: Hugging Face's forward pass, ``hf``, or the same model over fixed KV slabs, ``slab``)."""
    check_backend(backend)
    if attn_implementation not in INNER_IMPLEMENTATIONS:
        raise KvleagueError(
            f"attn_implementation: unknown {attn_implementation!r}; allowed: {', '.join(INNER_IMPLEMENTATIONS)}"
        )
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if attn_implementation == "flash_attention_2":
        _require_flash_attention(device)
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise KvleagueError(f"dtype: unknown {dtype!r}; allowed: auto, {', '.join(DTYPES)}")
    source = resolve_model(model)
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        hf_model = AutoModelForCausalLM.from_pretrained(
            source, dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
        # a module moves in place; transformers wraps ``to`` in a decorator pyright reads as unbound
        hf_model.to(device)  # pyright: ignore[reportArgumentType]
    except OSError as exc:
        raise KvleagueError(
            f"model: cannot load {model!r} (not a local checkpoint, and not on a reachable Hub): {first_line(exc)}"
        ) from None
    return Engine.on(hf_model, tokenizer, attn_implementation, backend)


def _require_flash_attention(device: str) -> None:
    try:
        import flash_attn  # noqa: F401  # pyright: ignore[reportMissingImports]  # an optional GPU extra
    except ImportError:
        raise KvleagueError(
            "attn_implementation: flash_attention_2 needs the flash-attn package (pip install 'kvleague[gpu]'); allowed here: sdpa, eager"
        ) from None
    if not device.startswith("cuda"):
        raise KvleagueError(
            f"attn_implementation: flash_attention_2 needs a CUDA device, got device={device!r}; allowed here: sdpa, eager"
        )
