"""The prefill benchmark; its code is flashgen/bench/prefill.py (run by `flashgen bench prefill` too), its options
`--help`. Imported (as benchmarks/experiments do), this name is that module itself, so that setting one of its
constants reaches the code that reads it.

    PYTHONPATH=$PWD python3 benchmarks/bench_prefill.py --out benchmarks/results/prefill.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.bench import prefill as _bench  # noqa: E402

if __name__ == "__main__":
    _bench.main()
else:
    sys.modules[__name__] = _bench
