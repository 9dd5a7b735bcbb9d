"""The CUDA-graph scaffold the wrapper tests share: capture run() once, then re-plan other batches and replay."""

from __future__ import annotations

import torch

from flashgen.plan import csr_to_block_table
from flashgen.testing.check import assert_matches_reference

# batches re-planned under one captured graph: empty requests, a single token, the first plan's batch again, the
# full batch size, lengths past a tile (each an argument tuple of the test's load())
REPLAN_BATCHES = (([300, 1, 0, 64, 5], [3000, 1, 7, 64, 900]), ([1], [1]), ([100, 3], [2000, 50]),
                  ([75] * 8, [75] * 8), ([129, 0, 257], [129, 5, 257]))


def fill_pools(pool_q, pool_kv, q, kv, nan_rest=False):
    """Write a batch's q and K/V at the head of the pools a captured graph reads (their addresses stay); with
    ``nan_rest`` the pools' other K/V rows hold NaN, so a row past the batch that reached the output would show."""
    for pool, part in zip(pool_kv, kv):
        assert part.shape[0] <= pool.shape[0], f"the batch needs {part.shape[0]} rows, the pool holds {pool.shape[0]}"
        if nan_rest:
            pool.fill_(float("nan"))
        pool[: part.shape[0]].copy_(part)
    pool_q[: q.shape[0]].copy_(q)


def replay_after_replanning(run, load, check, first, batches):
    """``load(*first)`` plans the batch that sizes the wrapper's fixed buffers; ``run()`` (returning
    ``(out, lse)``) is warmed up outside the capture and captured once. Then for each ``args`` in ``batches``:
    ``loaded = load(*args)`` writes new inputs into the captured pools and re-plans, out and lse are poisoned
    with NaN, the graph replays, and ``check(loaded, out, lse)`` compares. Returns the captured (out, lse)."""
    load(*first)
    run()  # compile, load, tensor maps: outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for args in batches:
        loaded = load(*args)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(loaded, out, lse)
    return out, lse


def fresh_page_ids(table, form, page_size, held):
    """A batch's CSR ``table`` (CPU) as plan() arguments whose page ids are a fresh device tensor: ``kv_indices``
    (``form="csr"``) or a ``block_table`` as wide as the batch's longest request, with ``seq_lens``. The tensors of
    earlier calls, kept alive in ``held`` (so the new one has a new address), are zeroed: a graph still reading
    one of them would read page 0 everywhere. Returns ``(plan kwargs, reference kwargs)``."""
    for old in held:
        old.zero_()
    if form == "csr":
        ids = table["kv_indices"].to(torch.int32).cuda()
        held.append(ids)
        return {**table, "kv_indices": ids}, table
    block_table, seq_lens = csr_to_block_table(table["kv_indptr"], table["kv_indices"], table["kv_last_page_len"],
                                               page_size)
    ids = block_table.cuda()
    held.append(ids)
    return {"block_table": ids, "seq_lens": seq_lens}, {"block_table": block_table, "seq_lens": seq_lens}


def reference_check(spec):
    """The ``check`` of ``replay_after_replanning`` for a ``load`` that returns ``(q, kv, page-table keywords,
    qo_indptr)``: the replayed rows of out and lse against the fp64 reference."""
    def check(loaded, out, lse):
        q, kv, table, qo_indptr = loaded
        n = q.shape[0]
        assert_matches_reference(spec, q, kv, out[:n], lse[:n], qo_indptr=qo_indptr, **table)
    return check
