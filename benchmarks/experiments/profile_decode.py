"""One decode call of flashgen and (if importable) FlashInfer's tensor-core decode on the same paged cache,
for a profiler: ``ncu --clock-control none -k regex:'decode|Batch' python3 benchmarks/experiments/profile_decode.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # benchmarks/, the repository
from bench_decode import BYTES_PER_TOKEN, D, HKV, HQ, paged_table  # noqa: E402

import flashgen  # noqa: E402
from flashgen import AttentionSpec, Paged  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kv-len", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    total, indptr, indices, last = paged_table(args.batch, args.kv_len, args.page_size, gen)
    cache = torch.randn(total, 2, args.page_size, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(args.batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    wrapper = flashgen.BatchDecodeWrapper(AttentionSpec(D, kv_layout=Paged(args.page_size)))
    wrapper.plan(num_qo_heads=HQ, num_kv_heads=HKV, kv_indptr=indptr, kv_indices=indices.cuda(), kv_last_page_len=last)
    for _ in range(2):
        wrapper.run(q, cache)
    try:
        import flashinfer

        fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(2**28, dtype=torch.uint8, device="cuda"), "NHD",
                                                           use_tensor_cores=True)
        fi.plan(indptr.cuda(), indices.cuda(), last.cuda(), HQ, HKV, D, args.page_size, q_data_type=torch.bfloat16)
        for _ in range(2):
            fi.run(q, cache)
    except ImportError as exc:
        print(f"flashinfer not importable: {exc}")
    torch.cuda.synchronize()
    print(f"bytes {args.batch * args.kv_len * BYTES_PER_TOKEN / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
