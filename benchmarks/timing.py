"""The timing module of the benchmarks lives in the package (flashgen/bench/timing.py) so that an installed
flashgen runs `flashgen bench`; ``import timing`` from a script here is that module itself (so setting
``timing.FLUSH`` reaches the code that reads it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.bench import timing as _timing  # noqa: E402

sys.modules[__name__] = _timing
