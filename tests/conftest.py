import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

ARCHS = ("llama", "qwen2", "qwen3")
REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One random-weight checkpoint per architecture (GQA: 4 query heads, 2 KV heads)."""
    from kvleague.runner.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def engines(tiny_models):
    from kvleague.runner.models import load_engine

    torch.set_num_threads(1)
    return {arch: load_engine(str(path)) for arch, path in tiny_models.items()}


@pytest.fixture(scope="session")
def prompt_ids(engines) -> list[int]:
    text = "In the beginning the cache was full, and every token was kept. " * 4
    return engines["llama"].tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="session")
def code_sandbox() -> None:
    """Skips where the code sandbox refuses to run (not root, no namespaces or cgroup: it never runs
    generated code with less), except under CI, where that is a failure."""
    from kvleague.tasks.sandbox import sandbox_refusal

    if (reason := sandbox_refusal()) is not None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the code sandbox refuses to run here: {reason}")


@pytest.fixture(scope="session")
def pg_server() -> str:
    """A PostgreSQL server for the database tests: $KVLEAGUE_PG_URL, or one started from Debian's binaries."""
    from kvleague.db.testing import postgres_server_url

    url = postgres_server_url()
    if url is None:
        pytest.skip(
            "PostgreSQL: KVLEAGUE_PG_URL is unset and no server binaries are installed (apt-get install postgresql)"
        )
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A new, empty database on each backend: a SQLite file, or a fresh database on the test server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'results.db'}"
        return
    from kvleague.db.testing import create_database, drop_database

    url = create_database(request.getfixturevalue("pg_server"))
    yield url
    drop_database(url)


#: the longest files first (seconds of one CI run, 2026-12-05: Ray jobs, killed workers and PostgreSQL
#: restarts 260 and 200, a browser 80, then ~65 to ~25): with ``--dist loadfile`` each file runs whole
#: on one worker, and a long file started last leaves the other worker idle while it runs.
#: ``scripts/test.sh`` passes ``--no-loadscope-reorder``, or xdist would order files by their number of
#: tests instead (it ran the four tests of test_sweep.py, ~3.5 minutes, last)
LONGEST_FIRST = (
    "test_faults.py",
    "test_sweep.py",
    "test_dashboard_browser.py",
    "test_batch.py",
    "test_backend_slab.py",
    "test_sweep_fidelity.py",
    "test_gpu_check.py",
    "test_method_matrix.py",
    "test_baselines_authors.py",
    "test_dashboard_views.py",
    "test_cli.py",
    "test_report.py",
    "test_model_source.py",
    "test_bench.py",
    "test_lmeval.py",
    "test_agentic.py",
    "test_tasks_code.py",
    "test_sweep_config.py",
    "test_faults_input.py",
    "test_db.py",
    "test_signals.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
