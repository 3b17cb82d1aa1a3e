"""gpulab.curriculum: the sequence-length pacing function (as DeepSpeed computes it), equal-token run
lengths, truncation, stream packing, the token-based learning-rate schedule and the spike counter."""

import math

import pytest
import torch

from gpulab.curriculum import (batch_warmup_rows, loss_spikes, lr_factor, pack_stream, seqlen_at, token_budget_lengths,
                               truncate)


def deepspeed_fixed_root(step, total, lo, hi, step_size, degree):
    """DeepSpeed's CurriculumScheduler.__fixed_root_get_difficulty, written out independently."""
    d = math.floor((step / total) ** (1.0 / degree) * (hi - lo) + lo)
    d -= d % step_size
    d = max(d, -(-lo // step_size) * step_size)
    return min(d, hi)


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_pacing_matches_deepspeeds_formula_and_its_invariants(degree):
    total, lo, hi = 40, 8, 64
    lengths = [seqlen_at(s, total, lo, hi, 8, degree) for s in range(1, 61)]
    assert lengths == [deepspeed_fixed_root(min(s, total), total, lo, hi, 8, degree) for s in range(1, 61)]
    assert lengths[0] == lo if degree == 1 else lengths[0] > lo  # a root pacing is past the start at step 1
    assert lengths[total - 1] == hi and set(lengths[total:]) == {hi}
    assert all(n % 8 == 0 for n in lengths)
    assert all(a <= b for a, b in zip(lengths, lengths[1:]))


def test_root_pacing_grows_faster_early_than_linear():
    linear = [seqlen_at(s, 100, 8, 1024) for s in range(1, 101)]
    root = [seqlen_at(s, 100, 8, 1024, root_degree=2) for s in range(1, 101)]
    assert all(r >= n for r, n in zip(root, linear)) and root[9] > 2 * linear[9]


def test_pacing_values_by_hand():
    # step 10 of 40 from 8 to 64: 10/40 * 56 + 8 = 22 -> 16 (multiple of 8)
    assert seqlen_at(10, 40, 8, 64) == 16
    assert seqlen_at(20, 40, 8, 64) == 32  # 36 -> 32
    assert seqlen_at(1, 100, 12, 64) == 16  # a start that is no multiple of 8 rounds up to one
    assert seqlen_at(5, 10, 3, 10, step_size=1) == 6  # 0.5 * 7 + 3 = 6.5 -> 6
    with pytest.raises(ValueError):
        seqlen_at(0, 10, 8, 64)


def test_token_budget_lengths_reach_the_budget_within_one_step():
    base = token_budget_lengths(8 * 64 * 80, 8, 0, 8, 64)
    assert base == [64] * 80
    curr = token_budget_lengths(8 * 64 * 80, 8, 40, 8, 64)
    tokens = 8 * sum(curr)
    assert 8 * 64 * 80 <= tokens < 8 * 64 * 80 + 8 * 64
    assert len(curr) > len(base) and curr[:2] == [8, 8] and curr[-1] == 64


def test_batch_warmup_takes_the_curriculums_tokens_per_step_in_full_rows():
    lengths = token_budget_lengths(8 * 64 * 40, 8, 20, 8, 64)
    rows = batch_warmup_rows(8 * 64 * 40, 8, 20, 8, 64)
    # 8 rows x 64 tokens per step at full size: rows = length / 8, exactly the curriculum's tokens
    assert rows == [n // 8 for n in lengths]
    assert 64 * sum(rows) == 8 * sum(lengths)
    # where the tokens do not divide into whole rows, round, and never below one row
    assert batch_warmup_rows(16 * 512 * 4, 16, 100, 8, 512)[:3] == [1, 1, 1]


def test_truncate_is_a_view_of_the_first_positions():
    batch = {"input_ids": torch.arange(24).view(2, 12), "labels": torch.arange(24).view(2, 12)}
    short = truncate(batch, 8)
    assert short["input_ids"].shape == (2, 8) and short["input_ids"][1, 0] == 12
    assert short["labels"].data_ptr() == batch["labels"].data_ptr()


def test_pack_stream_concatenates_and_drops_the_tail():
    rows = pack_stream([[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 9, 2]], 4)
    assert rows.tolist() == [[1, 5, 6, 2], [1, 7, 2, 1], [8, 9, 9, 2]]
    assert pack_stream([[1, 2, 3]], 2).tolist() == [[1, 2]]
    with pytest.raises(ValueError):
        pack_stream([[1, 2]], 4)


def test_lr_factor_warms_up_by_steps_and_decays_by_tokens():
    assert lr_factor(1, 0, 10, 1000) == pytest.approx(0.1)
    assert lr_factor(10, 0, 10, 1000) == pytest.approx(1.0)
    assert lr_factor(50, 500, 10, 1000) == pytest.approx(0.1 + 0.9 * 0.5)
    # a quarter of the way the cosine is still high (0.868); a linear decay would give 0.775
    assert lr_factor(50, 250, 10, 1000) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(99, 1000, 10, 1000) == pytest.approx(0.1)
    # the same tokens give the same rate whatever the step (once warm)
    assert lr_factor(20, 400, 10, 1000) == lr_factor(70, 400, 10, 1000)


def test_loss_spikes():
    assert loss_spikes([5, 4, 3, 2.5, 2.4, 2.3, 2.2, 2.9, 2.1, 2.0], ratio=1.2, skip=5) == [7]
    assert loss_spikes([5, 9, 3, 2, 1.9, 1.8], ratio=1.2, skip=5) == []  # early steps are not judged
