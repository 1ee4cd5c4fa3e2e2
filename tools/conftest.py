"""The tools are scripts, not a package: their tests import them from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
