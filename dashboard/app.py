"""Entry point: ``streamlit run dashboard/app.py [-- --db URL]`` (or ``kvleague dashboard``)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# ``streamlit run`` puts dashboard/ on the path, where its modules (commands.py, ui.py) would shadow
# libraries of those names: take it off; in a checkout that is not installed, the repository root
# (which holds the ``kvleague`` package) goes on instead.
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _HERE]
if (_HERE.parent / "kvleague" / "__init__.py").exists() and str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

from kvleague.dashboard.ui import main  # noqa: E402

main()
