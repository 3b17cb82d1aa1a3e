"""gpulab.feeding: costly batches that workers can load, trace parsing and overlap arithmetic."""

import time

import pytest
import torch
from torch.utils.data import DataLoader

from gpulab.feeding import CostlyBatches, LoadedBatch, Span, burn_cpu, draw_timeline, gpu_spans, overlap_fraction


def small_data(n=40):
    return {"input_ids": torch.arange(n * 3).view(n, 3), "labels": torch.arange(n) * 10}


def test_burn_cpu_spends_at_least_the_cpu_time_asked():
    start = time.thread_time()
    rounds = burn_cpu(0.01)
    assert rounds >= 1
    assert time.thread_time() - start >= 0.01


def test_costly_batches_are_fixed_slices_of_one_shuffled_order():
    data = small_data()
    ds = CostlyBatches(data, batch_size=4, n_batches=5, load_s=0.0, seed=3)
    assert len(ds) == 5
    item = ds[2]
    assert isinstance(item, LoadedBatch)
    rows = ds.order[2]
    assert torch.equal(item.batch["input_ids"], data["input_ids"][rows])
    assert torch.equal(item.batch["labels"], data["labels"][rows])
    assert item.span.lane == "main" and item.span.kind == "load" and item.span.end_s >= item.span.start_s
    all_rows = torch.cat([ds.order[k] for k in range(5)])
    assert len(set(all_rows.tolist())) == 20, "no example twice"
    assert torch.equal(CostlyBatches(data, 4, 5, 0.0, seed=3).order, ds.order), "same seed, same order"


def test_costly_batches_refuse_more_batches_than_the_data_holds():
    with pytest.raises(ValueError, match="need 44 examples"):
        CostlyBatches(small_data(40), batch_size=4, n_batches=11, load_s=0.0)


def test_workers_deliver_the_same_batches_in_the_same_order():
    ds = CostlyBatches(small_data(), batch_size=4, n_batches=6, load_s=0.001)
    by_main = list(DataLoader(ds, batch_size=None, num_workers=0))
    by_workers = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert [b.span.lane for b in by_main] == ["main"] * 6
    assert {b.span.lane for b in by_workers} == {"worker 0", "worker 1"}
    for a, b in zip(by_main, by_workers, strict=True):
        assert torch.equal(a.batch["input_ids"], b.batch["input_ids"])


def test_gpu_spans_reads_kernels_and_copies_by_stream():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1000.0, "dur": 500.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 1100.0, "dur": 200.0,
         "args": {"device": 0, "stream": 13, "bytes": 64}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 900.0, "dur": 10.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 950.0, "dur": 5.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 10.0, "dur": 1.0, "args": {"stream": 7}},
    ]}
    spans = gpu_spans(trace)
    assert [(s.lane, s.kind) for s in spans] == [("stream 7", "compute"), ("stream 13", "copy")]
    assert [(s.start_s, s.end_s) for s in spans] == [pytest.approx((1000e-6, 1500e-6)), pytest.approx((1100e-6, 1300e-6))]


def test_overlap_fraction_counts_shared_time_once():
    copies = [Span("s1", "copy", 0.0, 1.0), Span("s1", "copy", 2.0, 4.0)]
    kernels = [Span("s2", "compute", 0.5, 2.5), Span("s3", "compute", 0.6, 0.9)]  # overlapping kernels
    assert overlap_fraction(copies, kernels) == pytest.approx((0.5 + 0.5) / 3.0)
    assert overlap_fraction(copies, []) == 0.0
    assert overlap_fraction([], kernels) == 0.0
    assert overlap_fraction(kernels, kernels) == pytest.approx(1.0)


def test_draw_timeline_puts_one_row_per_lane():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    spans = [Span("worker 0", "load", 0.0, 0.01), Span("main", "compute", 0.01, 0.03)]
    draw_timeline(ax, spans, "t", lanes=["main", "worker 0"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["worker 0", "main"]  # bottom row first
    assert len(ax.collections) == 2
    # each bar sits on its lane's row: (start in ms, centre of the bar's height) against the tick of its lane
    rows = {label.get_text(): y for label, y in zip(ax.get_yticklabels(), ax.get_yticks())}
    corners = [path.vertices for c in ax.collections for path in c.get_paths()]
    bars = sorted((v[:, 0].min(), (v[:, 1].min() + v[:, 1].max()) / 2) for v in corners)
    assert bars == [pytest.approx((0.0, rows["worker 0"])), pytest.approx((10.0, rows["main"]))]
    plt.close(fig)
