import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One random-weight checkpoint per architecture (GQA: 4 query heads, 2 KV heads)."""
    from runner.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def engines(tiny_models):
    from runner.engine import Engine

    torch.set_num_threads(1)
    return {arch: Engine.load(str(path)) for arch, path in tiny_models.items()}


@pytest.fixture(scope="session")
def prompt_ids(engines) -> list[int]:
    text = "In the beginning the cache was full, and every token was kept. " * 4
    return engines["llama"].tokenizer(text, add_special_tokens=False)["input_ids"]
