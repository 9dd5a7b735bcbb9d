"""Host time of an eager decode step with and without the torch op layer (``flashgen.ops``).

Per call, the best of --repeats loops of --calls back-to-back calls (nothing synchronises inside a loop):
  run          ``wrapper.run(q, kv_cache, out=out)``: the eager API
  ops          ``flashgen.ops.decode_run(wrapper, q, kv_cache, out=out)``: what a model written for torch.compile
               calls; eager, it checks ``torch.compiler.is_compiling()`` and calls run()
  op_out       ``torch.ops.flashgen.decode_run_out(...)``: the custom op through the dispatcher (what a traced
               graph calls; under a CUDA graph this host time is gone)
  op           ``torch.ops.flashgen.decode_run(...)``: the functional op, which allocates out
  append       ``flashgen.append_kv`` (GPU only) beside ``append_op``, ``torch.ops.flashgen.append_kv``

On a GPU: bf16, 32 q / 8 kv heads, head_dim 128, page 16, --batch requests of --kv-len tokens. Without one (or with
--stand-in): a stand-in wrapper whose run() returns at once, so the figures are the op layer's cost alone.

    python3 benchmarks/bench_ops.py --out benchmarks/results/ops_host.json
    python3 benchmarks/bench_ops.py --stand-in        # the op layer alone, on any machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashgen  # noqa: E402
import flashgen.ops  # noqa: E402
from flashgen import AttentionSpec, Paged  # noqa: E402
from flashgen.api import handles  # noqa: E402
from flashgen.bench.timing import host_loop_us  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


class StandIn:
    """A planned wrapper that does no work: run() returns its out."""

    def __init__(self):
        self.spec = AttentionSpec(D, kv_layout=Paged(PAGE))
        self.op_handle = handles.assign(self)

    def run(self, q, kv_cache, out=None, return_lse=False):
        return out if out is not None else torch.empty_like(q)


def setup(args):
    """(wrapper, q, kv_cache, out, extra timed calls, sync) on the GPU, or with the stand-in."""
    if args.stand_in or not torch.cuda.is_available():
        q = torch.zeros(args.batch, HQ, D, dtype=torch.bfloat16)
        return StandIn(), q, torch.zeros(1, 2, PAGE, HKV, D, dtype=torch.bfloat16), torch.empty_like(q), {}, \
            lambda: None
    pages_each = -(-args.kv_len // PAGE)
    cache = torch.randn(args.batch * pages_each, 2, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    wrapper = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(PAGE)))
    last = args.kv_len - (pages_each - 1) * PAGE
    wrapper.plan(kv_indptr=[pages_each * b for b in range(args.batch + 1)],
                 kv_indices=torch.arange(args.batch * pages_each, dtype=torch.int32, device="cuda"),
                 kv_last_page_len=[last] * args.batch, num_qo_heads=HQ, num_kv_heads=HKV)
    q = torch.randn(args.batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(args.batch, HKV, D, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(args.batch, dtype=torch.int64, device="cuda") * pages_each * PAGE
    extra = {
        "append": lambda: flashgen.append_kv(k, k, cache, slot_mapping=slots),
        "append_op": lambda: torch.ops.flashgen.append_kv(k, k, cache, None, None, None, None, None, None, slots,
                                                          "NHD", None, None, None, None, None, None, None),
    }
    return wrapper, q, cache, torch.empty_like(q), extra, torch.cuda.synchronize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-len", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stand-in", action="store_true", help="time the op layer alone (no GPU work)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    wrapper, q, cache, out, extra, sync = setup(args)
    handle = wrapper.op_handle
    calls = {
        "run": lambda: wrapper.run(q, cache, out=out),
        "ops": lambda: flashgen.ops.decode_run(wrapper, q, cache, out=out),
        "op_out": lambda: torch.ops.flashgen.decode_run_out(handle, q, cache, None, out, False),
        "op": lambda: torch.ops.flashgen.decode_run(handle, q, cache, None, D, False),
        **extra,
    }
    figures = {name: host_loop_us(fn, args.calls, args.repeats, sync) for name, fn in calls.items()}
    device = torch.cuda.get_device_name() if isinstance(wrapper, flashgen.BatchDecodeWrapper) else "stand-in (CPU)"
    print(f"host us a call, {device}, torch {torch.__version__}, batch {args.batch}")
    for name, us in figures.items():
        print(f"  {name:10s} {us:7.2f}")
    if args.out:
        args.out.write_text(json.dumps({"device": device, "torch": torch.__version__, "batch": args.batch,
                                        "kv_len": args.kv_len, "host_us": figures}, indent=1))


if __name__ == "__main__":
    main()
