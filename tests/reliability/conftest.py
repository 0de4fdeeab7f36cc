"""The reliability suite: campaigns.py runs the campaigns; this tier sizes them short."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # campaigns.py, for the tests and run.py
