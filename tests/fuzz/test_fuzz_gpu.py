"""The fuzz in the GPU suite: every seed recorded in tests/fuzz/regressions.json, and a fixed sample of seeds,
each one case against the fp64 reference (``python -m tests.fuzz`` runs thousands; see tests/fuzz/__main__.py)."""

from __future__ import annotations

import pytest

from .__main__ import load_regressions
from .cases import case

pytestmark = pytest.mark.cuda

SAMPLE = range(200)  # seeds 0..199: every backend, graph groups, custom masks, long KV
REGRESSIONS = load_regressions()


def _params():
    params = [pytest.param(e["seed"], e.get("fresh_graph_ids", False), id=f"regression-{e['seed']}"
                           + ("-fresh" if e.get("fresh_graph_ids") else "")) for e in REGRESSIONS]
    return params + [pytest.param(seed, False, id=f"seed-{seed}") for seed in SAMPLE]


@pytest.fixture(scope="module")
def runner():
    """One runner for the module (wrappers, graph groups and pools shared), its kernels compiled up front."""
    import torch

    from .runner import Runner, compile_kernels, needed_kernels

    cases = [case(seed, fresh) for seed, fresh in [p.values for p in _params()]]
    compile_kernels(needed_kernels(cases, torch.cuda.get_device_capability()))
    return Runner()


@pytest.mark.parametrize("seed,fresh", _params())
def test_fuzz_case(runner, seed, fresh):
    result = runner.run(case(seed, fresh))
    assert result["status"] == "ok", f"{result['summary']}\n{result['status']}: {result['error']}"
