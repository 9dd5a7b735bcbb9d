"""flashgen's public ops as ``torch.library`` custom ops (namespace ``flashgen``), so that ``torch.compile(
fullgraph=True)`` traces a model that calls them and ``mode="reduce-overhead"`` captures them in CUDA graphs.

Example::

    import flashgen.ops

    wrapper = flashgen.BatchDecodeWrapper(spec, use_cuda_graph=True, max_batch_size=64)

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def step(x):
        q, k, v = project(x)
        flashgen.ops.append_kv(k, v, kv_cache, slot_mapping=slots)
        return flashgen.ops.decode_run(wrapper, q, kv_cache)

    wrapper.plan(...)   # plain Python, outside the compiled region, every step
    y = step(x)

The ops: ``flashgen::{decode,prefill,cascade,block_sparse,variable_block_sparse}_run`` (and ``*_run_out``, which
writes a given ``out``), ``flashgen::attention``, ``flashgen::merge_state``, ``flashgen::merge_state_in_place``,
``flashgen::merge_states``, ``flashgen::append_kv``; ``library.py`` holds their schemas and fake (meta)
implementations, ``calls.py`` the functions a model calls.

How a plan crosses into the compiled graph: as an int. Every wrapper registers itself when made and keeps the
handle as ``op_handle`` (``flashgen.api.handles``, held weakly); a traced call reads it (and ``spec.head_dim_vo``)
off the wrapper, so the graph holds a constant and a guard, and the op looks the wrapper up when it runs. Torch's
alternative, an opaque object, is a private API in torch 2.11 (``torch._library.opaque_object``, whose classes must
use its ``OpaqueBaseMeta``), so the ops use public APIs only: ``torch.library.Library`` (define, impl) and
``register_fake`` (torch >= 2.4; ``custom_op`` would add a Python autograd layer, ~4x the eager dispatch cost). The
ops have no autograd formula: they serve inference (run under ``torch.no_grad()`` or ``inference_mode``).
The plan's device arrays are not op inputs: the kernel reads them through addresses fixed in the params when
``plan()`` runs, so the compiler has nothing to order or copy. What makes a CUDA-graph replay correct is the
wrapper's ``use_cuda_graph=True`` (buffers and grid fixed at the first plan, later plans written into them), as
for a graph captured by hand; the KV cache must keep its address too (a module buffer, or
``torch._dynamo.mark_static_address``), since a graph input that is not static is copied before each replay.

``plan()`` stays a Python call outside the compiled region (as with FlashInfer and vLLM): it reads host arrays,
runs the planner and uploads, which a graph cannot capture. Call it before the compiled step, as in eager.

Eager cost: the functions here call the eager API directly unless they are being traced (``calls.py``), so an
eager model that uses them pays ~0.2 us more than ``wrapper.run`` and no dispatcher; calling ``torch.ops.flashgen``
directly in eager costs the dispatcher's Python round trip (``benchmarks/bench_ops.py`` measures both).
"""

from .calls import (append_kv, attention, block_sparse_run, cascade_run, decode_run, merge_state, merge_state_in_place,
                    merge_states, prefill_run, spec_json, variable_block_sparse_run)

__all__ = ["append_kv", "attention", "block_sparse_run", "cascade_run", "decode_run", "merge_state",
           "merge_state_in_place", "merge_states", "prefill_run", "spec_json", "variable_block_sparse_run"]
