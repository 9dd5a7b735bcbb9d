"""``flashgen demo``: the end-to-end run that works on any fresh machine with nvcc.

Without a GPU: show the toolchain, compile the default kernels for the target arch into the cache.
With a GPU: also run them on fresh random inputs and check them against the fp64 reference.
"""

from __future__ import annotations

import argparse
import time

from . import knobs
from .cli import cmd_build, cmd_info
from .compile import device_arch


def run_demo(arch: str | None) -> int:
    cmd_info(argparse.Namespace())
    target = arch or knobs.cuda_arch() or device_arch() or "sm_90a"
    print(f"\n== building the default kernels for {target}")
    cmd_build(argparse.Namespace(arch=target, plan=[], jobs=2))
    if device_arch() is None:
        print("\nno GPU visible: kernels compiled and cached; on a GPU machine `flashgen demo` also runs the merge "
              "kernels against the fp64 reference (and `pytest -m cuda` checks every kernel)")
        return 0
    print("\n== running them on the GPU against the fp64 reference")
    return 0 if _check_merge() else 1


def _check_merge() -> bool:
    import torch

    from .api import merge_state, merge_states
    from .testing.reference import merge_state_ref, merge_states_ref

    ok = True
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    for dtype, _ in ((torch.float16, 0), (torch.bfloat16, 0), (torch.float32, 0)):
        tokens, states, heads, dim = 1000, 5, 32, 128
        v = torch.randn(tokens, states, heads, dim, device="cuda", generator=gen).to(dtype)
        s = torch.randn(tokens, states, heads, device="cuda", generator=gen) * 4
        s[::7, 1] = float("-inf")  # empty partials
        s[::11] = float("-inf")  # fully empty rows
        out, lse = merge_states(v, s)
        ref_v, ref_s = merge_states_ref(v.double(), s.double())
        err_v = (out.double() - ref_v).abs().max().item()
        err_s = (lse.double() - ref_s).nan_to_num(posinf=0, neginf=0).abs().max().item()
        pair_v, pair_s = merge_state(v[:, 0].contiguous(), s[:, 0].contiguous(), v[:, 1].contiguous(), s[:, 1].contiguous())
        ref_pv, ref_ps = merge_state_ref(v[:, 0].double(), s[:, 0].double(), v[:, 1].double(), s[:, 1].double())
        err_p = (pair_v.double() - ref_pv).abs().max().item()
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype] * 4
        good = max(err_v, err_p) < tol and err_s < 1e-4 and torch.equal(lse.isinf(), ref_s.isinf())
        ok &= good
        print(f"merge_states/merge_state {str(dtype):15} max|err| v {err_v:.2e} pair {err_p:.2e} lse {err_s:.2e}  "
              f"{'ok' if good else 'FAILED'}")
    return ok
