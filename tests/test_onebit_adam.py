"""gpulab.onebit_adam: signs packed eight to a byte, error feedback that loses nothing for good, the bytes
on the wire, the warm-up equal to torch.optim.Adam, and the two-stage compressed all-reduce on 2 ranks."""

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpulab.memory import ModelShape
from gpulab.models import build_model
from gpulab.onebit_adam import (FlatLayout, OneBitAdam, WireCounter, compress, compress_with_feedback,
                                compressed_allreduce, decompress, onebit_allreduce_bytes, pack_signs,
                                powersgd_allreduce_bytes, ring_allreduce_bytes, unpack_signs)

SHAPE = ModelShape(vocab_size=200, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2)


def test_packing_round_trips_and_takes_one_bit_per_value():
    x = torch.randn(8 * 1000, generator=torch.Generator().manual_seed(0))
    x[:8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == x.numel() // 8
    signs = unpack_signs(packed)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))  # zero (and -0.0) count as +1
    assert signs[:8].tolist() == [1, 1, 1, -1, 1, -1, 1, -1]
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1])).item() == 0b10000001  # first value = high bit
    with pytest.raises(ValueError):
        pack_signs(torch.ones(7))


def test_block_scale_is_the_mean_magnitude_and_keeps_the_l1_norm():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).reshape(-1) * torch.arange(1, 5).repeat_interleave(64)
    packed, scales = compress(x, block=64)
    assert scales.shape == (4,)
    assert torch.allclose(scales, x.reshape(4, 64).abs().mean(1))
    out = decompress(packed, scales, 64)
    assert torch.allclose(out.reshape(4, 64).abs().sum(1), x.reshape(4, 64).abs().sum(1))
    # mean |x| is the scale that minimises || x - s sign(x) ||^2
    err = lambda s: float(((x[:64] - s * torch.sign(x[:64])) ** 2).sum())  # noqa: E731
    assert err(scales[0].item()) <= min(err(scales[0].item() * f) for f in (0.9, 0.99, 1.01, 1.1))


def test_error_feedback_keeps_the_running_sum():
    """sum_t C(x_t + e_{t-1}) = sum_t x_t - e_T: what compression drops is sent later, not lost."""
    gen = torch.Generator().manual_seed(2)
    error, sent_sum, true_sum, plain_sum = torch.zeros(512), torch.zeros(512), torch.zeros(512), torch.zeros(512)
    for _ in range(200):
        x = torch.randn(512, generator=gen) * 0.1 + 0.05
        _, _, sent = compress_with_feedback(x, error, block=128)
        sent_sum += sent
        true_sum += x
        plain_sum += decompress(*compress(x, 128), 128)
    assert torch.allclose(sent_sum + error, true_sum, atol=1e-4)
    # the residual stays bounded (one step's worth); without feedback the error of the sum grows
    assert (sent_sum - true_sum).norm() < 0.2 * (plain_sum - true_sum).norm()


def test_wire_bytes():
    assert ring_allreduce_bytes(1000, 2) == 1000 and ring_allreduce_bytes(1000, 8) == 1750
    d, n, block = 1 << 20, 4, 256
    fp32 = ring_allreduce_bytes(4 * d, n)
    assert onebit_allreduce_bytes(d, n, block) / fp32 == pytest.approx(1 / 32 + 1 / block)
    counter = WireCounter(world=4)
    counter.all_to_all(torch.zeros(d // 8, dtype=torch.uint8))
    counter.all_gather(torch.zeros(d // 8 // n, dtype=torch.uint8))
    assert counter.sent_bytes == 2 * (n - 1) / n * d / 8 and counter.calls == 2
    # PowerSGD: a 512 x 256 matrix at rank 4 sends (512 + 256) * 4 values; a vector goes whole
    assert powersgd_allreduce_bytes([(512, 256), (256,)], rank=4, world=2) == 4 * ((512 + 256) * 4 + 256)


def test_layout_pads_tensors_to_blocks_and_chunks():
    params = [torch.zeros(3, 5), torch.zeros(300), torch.zeros(17)]
    layout = FlatLayout.build(params, block=64, world=2)
    assert layout.offsets == [0, 64, 384] and layout.numel == 332
    assert layout.padded_numel == 512  # 384 + 17 rounded up to whole blocks on each of the 2 ranks
    values = [torch.randn_like(p) for p in params]
    flat = layout.flatten(values)
    back = [torch.empty_like(p) for p in params]
    layout.unflatten_into(flat, back)
    assert all(torch.equal(a, b) for a, b in zip(values, back))
    with pytest.raises(ValueError):
        FlatLayout.build(params, block=12, world=2)


def train_steps(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(4, SHAPE.vocab_size, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_warmup_is_torch_adam_and_then_the_variance_freezes():
    a, b = build_model(SHAPE, seed=0), build_model(SHAPE, seed=0)
    adam = torch.optim.Adam(a.parameters(), lr=1e-3, foreach=False)
    onebit = OneBitAdam(b.parameters(), lr=1e-3, warmup_steps=5)
    train_steps(a, adam, 5)
    train_steps(b, onebit, 5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)  # bit for bit: the same single-tensor update
    assert onebit.compressing
    v_before = [onebit.state[p]["exp_avg_sq"].clone() for p in b.parameters()]
    group = onebit.param_groups[0]
    (beta1, beta2), eps, lr = group["betas"], group["eps"], group["lr"]
    # Adam's bias-corrected denominator of the last warm-up step, written out here
    frozen = [v.sqrt() / (1 - beta2 ** 5) ** 0.5 + eps for v in v_before]
    train_steps(a, adam, 3, seed=1)
    gen = torch.Generator().manual_seed(1)  # train_steps(b, onebit, 3, seed=1), one step at a time
    for t in (6, 7, 8):  # one process: nothing to compress, but v is frozen
        ids = torch.randint(4, SHAPE.vocab_size, (2, 12), generator=gen)
        b(input_ids=ids, labels=ids).loss.backward()
        params = list(b.parameters())
        expected = [p - lr / (1 - beta1 ** t) * onebit.state[p]["exp_avg"].lerp(p.grad, 1 - beta1) / d
                    for p, d in zip(params, frozen)]
        onebit.step()
        onebit.zero_grad(set_to_none=True)
        for p, e in zip(params, expected):  # each step divides by the frozen denominator
            torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-9)
    assert all(torch.equal(v, onebit.state[p]["exp_avg_sq"]) for v, p in zip(v_before, b.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError):
        OneBitAdam(b.parameters(), warmup_steps=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_allreduce(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    block, d = 64, 1024
    worker, server = torch.zeros(d), torch.zeros(d // world)
    counter = WireCounter(world=world)
    results = []
    for step in range(3):
        x = torch.randn(d, generator=torch.Generator().manual_seed(10 * step + rank))
        results.append(compressed_allreduce(x, worker, server, block, counter))
    queue.put((rank, [r.tolist() for r in results], worker.tolist(), server.tolist(), counter.sent_bytes))
    dist.destroy_process_group()


def reference_two_stage(inputs, block, steps):
    """The same algorithm without communication: n workers and n servers in one process."""
    n, d = len(inputs[0]), inputs[0][0].numel()
    workers, servers = [torch.zeros(d) for _ in range(n)], [torch.zeros(d // n) for _ in range(n)]
    outs = []
    for step in range(steps):
        sent = [compress_with_feedback(inputs[step][r], workers[r], block)[2] for r in range(n)]
        average = torch.stack(sent).mean(0).reshape(n, d // n)
        outs.append(torch.cat([compress_with_feedback(average[j], servers[j], block)[2] for j in range(n)]))
    return outs, workers, servers


def test_two_ranks_match_the_reference_and_send_the_formula():
    world = 2
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=two_rank_allreduce, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((item[0], item[1:]) for item in (queue.get(timeout=110) for _ in range(world)))
    for p in procs:
        p.join(timeout=30)
    inputs = [[torch.randn(1024, generator=torch.Generator().manual_seed(10 * s + r)) for r in range(world)]
              for s in range(3)]
    outs, workers, servers = reference_two_stage(inputs, 64, 3)
    for r in range(world):
        results, worker, server, sent = got[r]
        for step in range(3):
            assert torch.allclose(torch.tensor(results[step]), outs[step], atol=1e-6)
        assert torch.allclose(torch.tensor(worker), workers[r], atol=1e-6)
        assert torch.allclose(torch.tensor(server), servers[r], atol=1e-6)
        assert sent == pytest.approx(3 * onebit_allreduce_bytes(1024, world, 64))
    assert math.isclose(onebit_allreduce_bytes(1024, world, 64), 2 * (world - 1) / world * (1024 / 8 + 4 * 1024 / 64))

