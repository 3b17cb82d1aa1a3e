"""The memory calculator's tensor-parallel degree against what a parallelized tiny Llama holds per rank.

Each rank of a tensor-parallel group holds the same bytes, so one process playing rank 0 (or 1) of 2 in
a fake process group measures what lab 14's two real processes measure: collectives move nothing, but
every shard, activation and collective has its real size. The lab's stored run shows the same numbers
from two gloo processes (parameters 6,333,440 B, activations 29,698,052 / 24,970,244 B per rank).
"""

import gc
import importlib.util
import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from gpulab.memory import KNOWN_SHAPES, TrainingSetup, estimate
from gpulab.memory.calculator import torch_sequence_parallel_extra_bytes, tp_local_shapes
from gpulab.memory.cli import main as cli_main
from gpulab.models import build_model
from gpulab.presets import PRESETS
from gpulab.tensor_parallel import CollectiveCounter, held_bytes, local, parallelize_llama, record_saved

TINY = PRESETS["tiny"].shape
BATCH, SEQ, T = 8, 64, 2
SCRIPT = Path(__file__).resolve().parents[1] / "labs" / "scripts" / "14_tensor_parallel.py"


def setup(t: int = T, sp: bool = False, **kw) -> TrainingSetup:
    return TrainingSetup(precision="fp32", optimizer="adamw", batch_size=BATCH, seq_len=SEQ, tp_degree=t,
                         sequence_parallel=sp, **kw)


@pytest.fixture
def fake_group(request):
    """Rank `request.param` (default 0) of 2 in a fake process group, torn down after the test."""
    rank = getattr(request, "param", 0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=T)
    torch.manual_seed(0)
    try:
        yield rank
    finally:
        dist.destroy_process_group()


def step(model, sequence_parallel: bool):
    """One forward and backward on a tiny batch; (bytes saved for backward, collectives)."""
    ids = torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    counter = CollectiveCounter()
    with counter, record_saved(exclude=list(model.parameters())) as saved:
        out = model(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ).unsqueeze(0))
        counter.phase = "backward"
        out.loss.backward()
    return saved.bytes, counter.summary()


# --- the calculator on its own ------------------------------------------------------------------------------

def test_record_saved_keeps_no_graph_alive():
    # as gpulab.memory.measure.record_saved_tensors: a counted forward dropped unrun frees its parameters
    layer = torch.nn.Linear(8, 8)
    weight = weakref.ref(layer.weight)
    with record_saved(exclude=layer.parameters()) as saved:
        out = torch.tanh(layer(torch.randn(2, 8)))
    assert saved.count == 2
    del out, layer
    gc.collect()
    assert weight() is None


def test_tp_degree_1_changes_nothing():
    for kw in ({}, {"seq_len": 64, "batch_size": 8}, {"zero_stage": 3, "world_size": 8, "seq_len": 32}):
        plain = estimate(TINY, TrainingSetup(precision="fp32", **kw))
        assert estimate(TINY, TrainingSetup(precision="fp32", tp_degree=1, sequence_parallel=True, **kw)) == plain


def test_tp_splits_projections_embeddings_and_head_not_norms():
    est = estimate(TINY, setup())
    h, layers = TINY.hidden_size, TINY.num_layers
    norms = (2 * layers + 1) * h
    assert est.parameters == ((TINY.num_params - norms) // T + norms) * 4 == 6_333_440
    assert est.gradients == est.parameters
    steps = 4 * len(TINY.param_tensor_shapes())  # one fp32 step counter per tensor, whole on every rank
    assert est.optimizer == 2 * est.parameters + steps
    assert sum(torch.Size(s).numel() for s in tp_local_shapes(TINY, T)) * 4 == est.parameters


def test_tp_with_zero3_and_kv_cache():
    shape = KNOWN_SHAPES["llama3-70b"]
    both = estimate(shape, TrainingSetup(zero_stage=3, world_size=8, tp_degree=8))
    fsdp = estimate(shape, TrainingSetup(zero_stage=3, world_size=64))
    # the same 64-way split of the model states, but for the norms, which tensor parallelism keeps whole
    # (and for AdamW's step counters, 4 bytes per tensor, which ZeRO splits over 64 ranks, not 8)
    whole = (shape.norm_params * 16 + 4 * len(shape.param_tensor_shapes())) * (1 / 8 - 1 / 64)
    assert both.parameters + both.gradients + both.optimizer == pytest.approx(
        fsdp.parameters + fsdp.gradients + fsdp.optimizer + whole, abs=4)
    kv = estimate(shape, TrainingSetup(kv_cache_len=4096))
    assert estimate(shape, TrainingSetup(kv_cache_len=4096, tp_degree=8)).kv_cache == kv.kv_cache / 8


def test_sequence_parallel_divides_every_layer_by_t():
    one_layer, two_layers = replace(TINY, num_layers=1), replace(TINY, num_layers=2)

    def layer(t: int, sp: bool) -> int:  # what one more decoder layer adds per rank
        return estimate(two_layers, setup(t, sp)).activations - estimate(one_layer, setup(t, sp)).activations

    # Korthikanti et al.: tensor parallelism leaves the norms' part whole, sequence parallelism splits it too
    assert layer(1, False) / T < layer(T, False) < layer(1, False)
    assert layer(T, True) * T == layer(1, False)
    extra = torch_sequence_parallel_extra_bytes(TINY, setup(T, True))
    assert extra == 2 * TINY.num_layers * BATCH * SEQ * TINY.hidden_size * 4 * (1 - 1 / T)
    assert torch_sequence_parallel_extra_bytes(TINY, setup(T, False)) == 0


def test_count_only_model_divides_everything_and_says_so():
    est = estimate(7e9, TrainingSetup(tp_degree=8))
    assert est.parameters == 7e9 * 2 / 8
    assert any("tensor parallel" in n for n in est.notes)


@pytest.mark.parametrize("kwargs", [{"tp_degree": 0}, {"tp_degree": 2, "lora_rank": 8},
                                    {"tp_degree": 2, "lora_rank": 8, "quantization": "nf4"}])
def test_bad_tensor_parallel_setups_are_rejected(kwargs):
    with pytest.raises(ValueError):
        TrainingSetup(**kwargs)


def test_tp_must_split_whole_heads():
    with pytest.raises(ValueError, match="heads"):
        estimate(TINY, TrainingSetup(tp_degree=4))  # 2 KV heads


def test_cli_takes_tp_and_sp(capsys):
    assert cli_main(["--model", "llama3-70b", "--seq", "4096", "--tp", "8", "--sp", "--zero", "3", "--gpus", "8",
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = estimate(KNOWN_SHAPES["llama3-70b"], TrainingSetup(seq_len=4096, tp_degree=8, sequence_parallel=True,
                                                              zero_stage=3, world_size=8))
    assert got == want.to_dict()
    with pytest.raises(SystemExit) as err:
        cli_main(["--model", "llama3-70b", "--tp", "3"])
    assert err.value.code == 2


# --- the calculator against a parallelized model ----------------------------------------------------------------

@pytest.mark.parametrize("fake_group", [0, 1], indirect=True)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_calculator_matches_dtensor_plan_per_rank(fake_group, sequence_parallel):
    model = build_model(TINY, seed=0)
    parallelize_llama(model, init_device_mesh("cpu", (T,)), sequence_parallel=sequence_parallel)
    saved, collectives = step(model, sequence_parallel)
    est = estimate(TINY, setup(T, sequence_parallel))
    params = list(model.parameters())
    assert held_bytes(params) == est.parameters
    # DTensor computes the vocabulary-split embedding's gradient whole (replicated) on every rank
    embedding_rest = (TINY.vocab_size - TINY.vocab_size // T) * TINY.hidden_size * 4
    assert held_bytes(p.grad for p in params) == est.gradients + embedding_rest
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    assert held_bytes(local(v) for s in opt.state.values() for v in s.values()) == est.optimizer
    extra = torch_sequence_parallel_extra_bytes(TINY, setup(T, sequence_parallel))
    assert saved == est.activations + extra == (24_970_244 if sequence_parallel else 29_698_052)
    layers, act = TINY.num_layers, BATCH * SEQ * TINY.hidden_size * 4
    if not sequence_parallel:  # 2 per layer + embedding (forward), + LM head input (backward)
        assert collectives["forward"]["all_reduce"] == {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * act}
        assert collectives["backward"]["all_reduce"] == {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * act}
    else:
        assert collectives["forward"]["reduce_scatter"]["calls"] == 2 * layers + 1
        assert "all_reduce" not in collectives["forward"]


def load_script():
    spec = importlib.util.spec_from_file_location("tensor_parallel_lab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["scratch_tp", "scratch_sp"])
def test_hand_written_megatron_matches_calculator_and_shoeybi_count(fake_group, kind):
    lab = load_script()
    model = lab.build(kind, torch.device("cpu"))
    sp = kind == "scratch_sp"
    saved, collectives = step(model, sp)
    assert saved == estimate(TINY, setup(T, sp)).activations
    layers, act = TINY.num_layers, BATCH * SEQ * TINY.hidden_size * 4
    if not sp:  # Shoeybi et al.: 2 all-reduces per layer forward, 2 backward, nothing else
        assert collectives == {"forward": {"all_reduce": {"calls": 2 * layers, "bytes": 2 * layers * act}},
                               "backward": {"all_reduce": {"calls": 2 * layers, "bytes": 2 * layers * act}}}
    else:  # all-gather + reduce-scatter per block; backward gathers each block's input again
        assert collectives["forward"]["reduce_scatter"] == {"calls": 2 * layers, "bytes": 2 * layers * act}
        assert collectives["forward"]["all_gather"] == {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * act}
        assert collectives["backward"]["all_gather"]["calls"] == 4 * layers + 1


def test_counter_sees_c10d_and_functional_collectives(fake_group):
    import torch.distributed._functional_collectives as funcol

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 / 2.11
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    counter = CollectiveCounter()
    x = torch.ones(4, 8)
    with counter:
        dist.all_reduce(x)
        all_gather(torch.empty(8, 8), x)
        counter.phase = "later"
        reduce_scatter(torch.empty(2, 8), x)
        functional_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # DTensor's kind
        functional_gather(x, 0, dist.group.WORLD).wait()  # the output: 2 x 128 B
    assert counter.summary() == {"forward": {"all_reduce": {"calls": 1, "bytes": 128},
                                             "all_gather": {"calls": 1, "bytes": 256}},
                                 "later": {"reduce_scatter": {"calls": 1, "bytes": 128},
                                           "all_gather": {"calls": 1, "bytes": 256}}}
