"""The largest tensor an operation creates, views, in-place results and the returned value left out."""

import torch

from gpulab.intermediates import largest_intermediate


def test_largest_new_tensor_is_found_and_the_result_excluded():
    x = torch.randn(8, 16)

    def fn():
        x[:2].clone()  # an intermediate of 2 x 16 floats, freed at once
        return x.repeat(4, 1)  # the result: 32 x 16, larger than the intermediate, so it must be left out

    largest, result = largest_intermediate(fn)
    assert result.shape == (32, 16)
    assert largest.bytes == 2 * 16 * 4 and largest.shape == (2, 16) and largest.op == "clone"


def test_views_and_in_place_ops_allocate_nothing():
    x = torch.randn(64, 64)

    def fn():
        y = x.t()  # a view of the input
        y.mul_(2)  # in place
        return x[:1].sum()

    largest, _ = largest_intermediate(fn)
    assert largest.bytes == 0  # the returned sum is the only new tensor, and the result is left out


def test_backward_ops_are_seen_and_shapes_can_be_ignored():
    w = torch.randn(100, 50, requires_grad=True)
    x = torch.randn(3, 50)

    def step():
        (x @ w.t()).square().sum().backward()

    largest, _ = largest_intermediate(step)
    assert largest.shape == (100, 50)  # the weight's gradient, made in backward
    largest, _ = largest_intermediate(step, ignore_shapes=[tuple(w.shape)])
    assert largest.bytes == 3 * 100 * 4
