"""Entry point: ``streamlit run dashboard/app.py [-- --db URL]`` (or ``kvleague dashboard``)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = str(_HERE.parent)
# ``streamlit run`` puts dashboard/ on the path, where its modules (commands.py, ui.py) would shadow
# libraries of those names: import this package from the repository root instead.
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _HERE]
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from dashboard.ui import main  # noqa: E402

main()
