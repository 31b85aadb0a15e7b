"""Random-weight checkpoints and a byte-level tokenizer built entirely offline.

Tests and the demo use these instead of Hub downloads; they load through the same
``AutoModelForCausalLM`` / ``AutoTokenizer`` path as a real checkpoint does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from kvleague.engine.errors import KvleagueError

ARCHS = ("llama", "qwen2", "qwen3")
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
# ChatML, the template family of the Qwen models kvleague targets.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte symbols, no merges, so no training) plus special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return chat_tokenizer(backend)


def chat_tokenizer(backend: Tokenizer, **options) -> PreTrainedTokenizerFast:
    """``backend`` with the special tokens and ChatML template every offline tokenizer here shares;
    ``options`` go to ``PreTrainedTokenizerFast`` (e.g. ``unk_token``)."""
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        **options,
    )


def tiny_config(arch: str, *, vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int):
    if arch not in ARCHS:
        raise KvleagueError(f"arch: unknown {arch!r}; allowed: {', '.join(ARCHS)}")
    if hidden % heads or heads % kv_heads:
        raise KvleagueError(
            f"heads: hidden ({hidden}) must divide by heads ({heads}) and heads by kv-heads ({kv_heads})"
        )
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        # Larger than the 0.02 default so random logits are peaked: near-ties would make greedy
        # decoding sensitive to float rounding and token-exact comparisons flaky.
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=260,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(head_dim=hidden // heads, **common)


def make_tiny_model(
    arch: str,
    out: str | Path,
    *,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """Write a random-weight ``arch`` checkpoint and the byte-level tokenizer to ``out``."""
    tokenizer = byte_level_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # QK-norm weights (qwen3) start at 1, which makes every key's norm sqrt(head_dim) in exact
    # arithmetic: key-norm scores would all tie and rank float rounding, device- and batch-dependent.
    # Trained checkpoints have learned weights; spread them so that keys differ as they do there.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
