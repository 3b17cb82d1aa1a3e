"""Packing: rows filled by first-fit decreasing, masks that keep sequences apart, and the padding saved."""

import pytest
import torch

from gpulab.models import build_model
from gpulab.packing import (IGNORE_INDEX, additive_mask, block_diagonal_causal_mask, first_fit_decreasing, pack,
                            padding_costs, segments_from_position_ids)
from gpulab.presets import PRESETS


def test_first_fit_decreasing_fills_rows_and_keeps_every_sequence():
    lengths = [5, 9, 3, 7, 2, 6]
    rows = first_fit_decreasing(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 4  # 32 tokens need at least 4 rows of 10
    with pytest.raises(ValueError):
        first_fit_decreasing([11], 10)


def test_pack_restarts_positions_and_labels():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    batch = pack(seqs, capacity=6, pad_id=0)
    assert batch.input_ids.shape == (2, 6)
    assert sorted(i for members in batch.rows for i in members) == [0, 1, 2]
    for r, members in enumerate(batch.rows):
        start = 0
        for i in members:
            n = len(seqs[i])
            assert batch.input_ids[r, start:start + n].tolist() == seqs[i]
            assert batch.position_ids[r, start:start + n].tolist() == list(range(n))
            assert batch.labels[r, start] == IGNORE_INDEX  # no token predicts another sequence's start
            # the rest are the sequence's own tokens (the model shifts them: position t predicts t + 1)
            assert batch.labels[r, start + 1:start + n].tolist() == seqs[i][1:]
            assert (batch.sequence_ids[r, start:start + n] == i).all()
            start += n
        assert (batch.labels[r, start:] == IGNORE_INDEX).all()
        assert (batch.sequence_ids[r, start:] == -1).all()


def test_segments_and_the_block_diagonal_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    seg = segments_from_position_ids(pos)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2]]
    mask = block_diagonal_causal_mask(seg)
    assert mask.shape == (1, 1, 6, 6)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[0, 0, 2].tolist() == [True, True, True, False, False, False]
    float_mask = additive_mask(mask)
    assert float_mask[0, 0, 4, 3] == 0 and float_mask[0, 0, 4, 0] == torch.finfo(torch.float32).min


def test_packed_rows_give_each_sequence_its_logits_alone():
    shape = PRESETS["tiny"].shape
    model = build_model(shape).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, shape.vocab_size, (n,), generator=gen).tolist() for n in (7, 12, 5, 9)]
    batch = pack(seqs, capacity=20)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        mask = block_diagonal_causal_mask(segments_from_position_ids(batch.position_ids))
        out_mask = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask,
                         use_cache=False).logits
        for r, members in enumerate(batch.rows):
            start = 0
            for i in members:
                alone = model(input_ids=torch.tensor([seqs[i]]), use_cache=False).logits[0]
                n = len(seqs[i])
                assert torch.allclose(out[r, start:start + n], alone, atol=1e-4)
                assert torch.allclose(out_mask[r, start:start + n], alone, atol=1e-4)
                start += n


def test_padding_costs():
    fixed, per_batch, packed, flat = padding_costs([10, 20, 30, 40], batch_size=2, pad_to=50, capacity=50)
    assert (fixed.positions, per_batch.positions, flat.positions) == (200, 2 * 20 + 2 * 40, 100)
    assert packed.rows == 2 and packed.positions == 100 and packed.efficiency == 1.0
    assert per_batch.attention_pairs == 2 * 20**2 + 2 * 40**2 and flat.attention_pairs == 100**2
