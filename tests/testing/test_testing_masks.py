"""The test masks both prefill kernels' GPU tests use (flashgen.testing.masks): shapes, the properties each kind
promises, the host forms, and errors that name the argument."""

import numpy as np
import pytest
import torch

from flashgen.testing.masks import as_form, doc_mask, make_masks
from flashgen.testing.reference import pack_custom_mask

QO, KV = [0, 3, 130, 40], [5, 300, 130, 0]


@pytest.mark.parametrize("kind", ["random0.3", "doc", "blocks", "causal", "zeros", "ones", "empty_rows"])
def test_kinds_have_the_requests_shapes(kind):
    masks = make_masks(kind, QO, KV, torch.Generator().manual_seed(0))
    assert [tuple(m.shape) for m in masks] == list(zip(QO, KV)) and all(m.dtype == torch.bool for m in masks)


def test_kinds_keep_their_promises():
    gen = torch.Generator().manual_seed(1)
    causal = make_masks("causal", [3], [5], gen)[0]
    assert causal.tolist() == [[k <= 2 + q for k in range(5)] for q in range(3)]  # aligned to the KV end
    rows = make_masks("empty_rows", [130], [300], gen)[0]
    assert not rows[::2].any() and not rows[:, 128:256].any() and rows[1::2, :128].any()
    blocks = make_masks("blocks", [128], [512], gen)[0]
    tiles = blocks.view(4, 32, 8, 64).float().mean(dim=(1, 3))
    assert (tiles == 0).any() and (tiles == 1).any()  # EMPTY and FULL tiles side by side
    dense = make_masks("random0.9", [200], [200], gen)[0].float().mean()
    assert 0.85 < dense < 0.95


def test_doc_mask_is_causal_within_documents():
    full = doc_mask(12, 12, 3)  # documents of 4 tokens
    assert full[5].tolist() == [False] * 4 + [True, True] + [False] * 6
    assert torch.equal(doc_mask(4, 12, 3), full[8:])  # queries are the KV's last tokens
    assert not doc_mask(5, 3, 1).any()


def test_host_forms_hold_the_packed_bits():
    masks = make_masks("random0.5", QO, KV, torch.Generator().manual_seed(2))
    packed = pack_custom_mask(masks)
    assert as_form(masks, "list") is masks
    assert torch.equal(as_form(masks, "host"), packed)
    assert np.array_equal(as_form(masks, "numpy"), packed.numpy())


def test_unknown_kinds_and_forms_are_named():
    with pytest.raises(ValueError, match="^kind: got 'stripes'"):
        make_masks("stripes", [1], [1], torch.Generator())
    with pytest.raises(ValueError, match="^form: got 'file'"):
        as_form([torch.ones(1, 1, dtype=torch.bool)], "file")
