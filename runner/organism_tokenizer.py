"""The organism's tokenizer: one token per fact of the synthetic tasks, characters for the rest.

The synthetic tasks (:mod:`tasks.synthetic`) state facts as ``k=42``: a one-letter key and a value
0-99. This tokenizer makes each such fact **one token** (``a=0`` .. ``z=99``, ``A=0`` .. ``Z=99``),
so answering is an associative lookup of one token rather than an induction over two
(``k`` then ``=42``). Measured here, on 2 CPU cores, 2-layer Llama, hidden 192: with two-token
facts, value accuracy was still 0% after 2,150 lookup steps (the induction plateau); with one token
per fact on synthetic ids, the same model reached 62% after 600 steps. (On the full task mixture a
22-minute run still answered ~0% of held-out samples; see :mod:`runner.organism`.)

Built offline, no training: a Unigram model whose pieces are

* every printable ASCII character, ``\\n`` and ``\\t`` (score -5): any ASCII text is representable;
* the 256 byte-fallback pieces ``<0x00>``..``<0xFF>`` (score -20): any other text too, exactly;
* the 5,200 facts ``x=N`` (score -1), the numbers 10-99 and the words of the synthetic tasks'
  templates and chat roles (score -1): one piece beats several characters.

The pre-tokenizer splits text into facts (a letter not preceded by a letter, ``=``, one or two
digits not followed by a digit), letter runs, digit runs and single other characters, so ``k=42``
is the same token after a newline, a space or a colon, and ``kp=42`` or ``k=420`` are not facts.
Decoding concatenates the pieces (byte fallback reassembled): ``decode(encode(text)) == text``.
"""

from __future__ import annotations

import re
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from runner.tiny_model import chat_tokenizer

_SPLIT = r"(?<![A-Za-z])[A-Za-z]=[0-9]{1,2}(?![0-9])|[A-Za-z]+|[0-9]+|[^A-Za-z0-9]"
FACT_RE = re.compile(r"(?<![A-Za-z])[A-Za-z]=[0-9]{1,2}(?![0-9])")


def _task_words() -> list[str]:
    """Words of the synthetic tasks' templates and vocabularies (two letters or more)."""
    from tasks import synthetic as s

    text = " ".join([
        s.AGENTIC_SYSTEM, *s._FILLER_SUBJECTS, *s._FILLER_VERBS, *s._FILLER_OBJECTS, *s._LOG_WORDS,
        *s.HEADERS.values(), "call get log recall print code system user assistant tool ok",
    ])
    return sorted({w for w in re.findall(r"[A-Za-z]+", text) if len(w) > 1})


def organism_pieces() -> list[tuple[str, float]]:
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    facts = [f"{k}={n}" for k in string.ascii_letters for n in range(100)]
    words = facts + [str(n) for n in range(10, 100)] + _task_words()
    pieces: list[tuple[str, float]] = [("<unk>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    pieces += [(c, -5.0) for c in chars]
    seen = {p for p, _ in pieces}
    pieces += [(w, -1.0) for w in dict.fromkeys(words) if w not in seen]
    return pieces


def organism_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer described above, with the special tokens and ChatML template of the tiny models."""
    backend = Tokenizer(models.Unigram(organism_pieces(), unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return chat_tokenizer(backend, unk_token="<unk>", clean_up_tokenization_spaces=False)
