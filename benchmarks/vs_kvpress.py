"""Script entry point of ``kvleague bench`` (see :mod:`runner.bench.vs_kvpress`)::

    python benchmarks/vs_kvpress.py --help
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runner.bench.vs_kvpress import main  # noqa: E402

if __name__ == "__main__":
    main()
