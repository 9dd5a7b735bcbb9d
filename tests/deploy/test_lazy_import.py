"""``import flashgen`` imports nothing heavy: the code generator (jinja2), the CUDA driver bindings, the planner
(numpy-heavy) and the wrappers load on first use of a public name. Checked in a fresh interpreter, as the set
of modules ``import flashgen`` adds after ``import torch`` (torch itself may import cuda-python). The time it
takes is measured by benchmarks/startup_bench.py, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("jinja2", "cuda", "flashgen.api", "flashgen.kernels", "flashgen.plan", "flashgen.runtime",
         "flashgen.compile", "flashgen.jit", "filelock")


def _new_modules(code: str) -> list[str]:
    script = ("import sys, json, torch\nbefore = set(sys.modules)\n" + code +
              "\nprint(json.dumps(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_flashgen_pulls_in_nothing_heavy():
    new = _new_modules("import flashgen")
    heavy = [m for m in new if m.split(".")[0] in HEAVY or m.startswith(HEAVY)]
    assert not heavy, f"import flashgen imported {heavy}"


def test_loading_path_leaves_the_code_generator_out():
    # what a server that only loads cached kernels imports: the wrappers and the build-and-load step
    new = _new_modules("import flashgen\nflashgen.BatchDecodeWrapper\nimport flashgen.jit")
    assert "flashgen.api" in new and "flashgen.jit" in new
    assert not [m for m in new if m.split(".")[0] == "jinja2"], "the load path imported jinja2"


def test_public_names_resolve_lazily():
    import flashgen

    for name in flashgen.__all__:
        assert getattr(flashgen, name) is not None, name
    assert set(flashgen.__all__) <= set(dir(flashgen))
    try:
        flashgen.NoSuchName
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
