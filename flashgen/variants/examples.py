"""Shipped variants, each written as a traced Python hook and, where natural, as a CUDA snippet; the two
spellings of one example compute the same thing (``tests/variants`` checks the traced one against the fp64
references of ``flashgen.testing.variants``)."""

from __future__ import annotations

from .. import variant_ops as ops
from ..spec import Scalar, Tensor, Variant

# attention sinks (gpt-oss): a learned per-head logit joins the softmax denominator only
SINK = Variant(sink=lambda h, sinks: sinks[h], tensors=[Tensor("sinks", "float32", 1)])
SINK_CUDA = Variant(sink="return sinks[qo_head];", tensors=[Tensor("sinks", "float32", 1)])

# document mask: a token attends only within its document (doc_ids: [total tokens] int32)
DOCUMENT = Variant(mask=lambda q_idx, kv_idx, doc_ids: doc_ids[q_idx] == doc_ids[kv_idx],
                   tensors=[Tensor("doc_ids", "int32", 1)])
DOCUMENT_CUDA = Variant(mask="return doc_ids[qo_idx] == doc_ids[kv_idx];", tensors=[Tensor("doc_ids", "int32", 1)])



# the document mask over sorted document ids (packed sequences) with its tile predicate: a tile whose keys all lie in
# documents before or after every query's is empty (skipped), one inside a single document is full (no per-pair
# mask). The ids must be non-decreasing, or the predicate would disagree with the mask.
def _document_tile(qo_begin, qo_end, kv_begin, kv_end, doc_ids):
    q_first, q_last = doc_ids[qo_begin], doc_ids[qo_end - 1]
    k_first, k_last = doc_ids[kv_begin], doc_ids[kv_end - 1]
    empty = (k_last < q_first) | (k_first > q_last)
    full = (k_first == k_last) & (q_first == q_last) & (k_first == q_first)
    return ops.where(empty, ops.TILE_EMPTY, ops.where(full, ops.TILE_FULL, ops.TILE_PARTIAL))


DOCUMENT_TILED = Variant(mask=lambda q_idx, kv_idx, doc_ids: doc_ids[q_idx] == doc_ids[kv_idx], mask_tile=_document_tile,
                         tensors=[Tensor("doc_ids", "int32", 1)])
DOCUMENT_TILED_CUDA = Variant(mask="return doc_ids[qo_idx] == doc_ids[kv_idx];", mask_tile="""
    const int q_first = doc_ids[qo_begin], q_last = doc_ids[qo_end - 1];
    const int k_first = doc_ids[kv_begin], k_last = doc_ids[kv_end - 1];
    if (k_last < q_first || k_first > q_last) return TILE_EMPTY;
    return k_first == k_last && q_first == q_last && k_first == q_first ? TILE_FULL : TILE_PARTIAL;
""", tensors=[Tensor("doc_ids", "int32", 1)])

# tree mask (speculative decoding): bit j of ancestors[i] says draft token i may see draft token j (<= 64 tokens)
TREE = Variant(mask=lambda q_idx, kv_idx, ancestors: ((ancestors[q_idx] >> kv_idx) & 1) == 1,
               tensors=[Tensor("ancestors", "int64", 1)])
TREE_CUDA = Variant(mask="return ((ancestors[qo_idx] >> kv_idx) & 1) != 0;", tensors=[Tensor("ancestors", "int64", 1)])


def t5_bucket(rel, num_buckets: int = 32, max_distance: int = 128):
    """T5's bidirectional relative-position bucket of ``rel = kv_idx - qo_idx`` (traceable)."""
    half = num_buckets // 2
    exact = half // 2
    n = ops.abs(rel)
    large = exact + ops.log((n + 1e-6) / exact) / ops.log(max_distance / exact) * (half - exact)
    large = ops.minimum(ops.where(large >= 0, large, 0.0), half - 1.0)
    bucket = ops.where(n < exact, n + 0.0, large)
    return ops.where(rel > 0, half, 0) + ops.floor(bucket)


# T5 relative-position bias: a learned [heads, buckets] table indexed by the bucket of kv_idx - qo_idx
def _t5_score(score, q_idx, kv_idx, h, rel_bias):
    bucket = t5_bucket(kv_idx - q_idx)
    return score + rel_bias[h, bucket]


T5_BIAS = Variant(score=_t5_score, tensors=[Tensor("rel_bias", "float32", 2)])

# ALiBi with arbitrary slopes: slopes[h] * (kv_idx - qo_idx). The snippet reads the float input distance
# (kv_idx - qo_idx, which the kernels form without an int -> float conversion a pair); the traced hook's
# float(kv_idx - q_idx) becomes distance by itself.
ALIBI = Variant(score=lambda score, h, q_idx, kv_idx, slopes: score + slopes[h] * (kv_idx - q_idx),
                tensors=[Tensor("slopes", "float32", 1)])
ALIBI_CUDA = Variant(score="return logit + slopes[qo_head] * distance;", tensors=[Tensor("slopes", "float32", 1)])

# sigmoid attention: w = sigmoid(logit + bias), no softmax normaliser
SIGMOID = Variant(score=lambda score, bias: ops.sigmoid(score + bias), scalars=[Scalar("bias", "float32")],
                  softmax=False)
SIGMOID_CUDA = Variant(score="return fg_sigmoid(logit + bias);", scalars=[Scalar("bias", "float32")], softmax=False)

# prefix-LM: the first prefix_len[b] tokens see each other both ways; the rest is causal. The snippet says | where
# || would do: || reads prefix_len[batch] under a branch a pair, | reads it once a row (as the traced hook does).
# Its tile predicate: a tile whose keys all lie past every query and past the prefix is empty, one whose keys all
# lie in the prefix or at or before its first query is full.
def _prefix_lm_tile(b, qo_begin, qo_end, kv_begin, kv_end, prefix_len):
    prefix = prefix_len[b]
    empty = (kv_begin >= qo_end) & (kv_begin >= prefix)
    full = (kv_end - 1 <= qo_begin) | (kv_end <= prefix)
    return ops.where(empty, ops.TILE_EMPTY, ops.where(full, ops.TILE_FULL, ops.TILE_PARTIAL))


PREFIX_LM = Variant(mask=lambda b, q_idx, kv_idx, prefix_len: (kv_idx <= q_idx) | (kv_idx < prefix_len[b]),
                    mask_tile=_prefix_lm_tile, tensors=[Tensor("prefix_len", "int32", 1)])
PREFIX_LM_CUDA = Variant(mask="return (kv_idx <= qo_idx) | (kv_idx < prefix_len[batch]);", mask_tile="""
    const int prefix = prefix_len[batch];
    if (kv_begin >= qo_end && kv_begin >= prefix) return TILE_EMPTY;
    return kv_end - 1 <= qo_begin || kv_end <= prefix ? TILE_FULL : TILE_PARTIAL;
""", tensors=[Tensor("prefix_len", "int32", 1)])

# learned per-dimension q and k gains at load (QK-norm's learned scale on its own; q_gain: [q heads, head_dim], k_gain:
# [kv heads, head_dim], float32): q[d] * q_gain[h, d] and k[d] * k_gain[h_kv, d], each element as it is loaded,
# before the spec's RoPE (decode, the portable prefill and, without RoPE, the Hopper prefill)
QK_GAIN = Variant(q_transform=lambda x, h, dim, q_gain: x * q_gain[h, dim],
                  k_transform=lambda x, h, dim, k_gain: x * k_gain[h, dim],
                  tensors=[Tensor("q_gain", "float32", 2), Tensor("k_gain", "float32", 2)])
QK_GAIN_CUDA = Variant(q_transform="return value * q_gain(qo_head, dim);",
                       k_transform="return value * k_gain(kv_head, dim);",
                       tensors=[Tensor("q_gain", "float32", 2), Tensor("k_gain", "float32", 2)])

EXAMPLES = {
    "sink": (SINK, SINK_CUDA),
    "document": (DOCUMENT, DOCUMENT_CUDA),
    "document_tiled": (DOCUMENT_TILED, DOCUMENT_TILED_CUDA),
    "tree": (TREE, TREE_CUDA),
    "t5_bias": (T5_BIAS, None),
    "alibi": (ALIBI, ALIBI_CUDA),
    "sigmoid": (SIGMOID, SIGMOID_CUDA),
    "prefix_lm": (PREFIX_LM, PREFIX_LM_CUDA),
    "qk_gain": (QK_GAIN, QK_GAIN_CUDA),
}
