"""The calculator against published figures and against itself."""

import dataclasses
import math

import pytest

from gpulab.memory import KNOWN_SHAPES, ModelShape, TrainingSetup, activation_terms, estimate
from gpulab.memory.calculator import quantized_bytes_per_param

GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_worked_example(stage, expected_gb):
    # ZeRO (Rajbhandari et al. 2019) Table 1 / Sec. 5: 7.5B parameters, 64 GPUs, mixed-precision Adam.
    est = estimate(7.5e9, TrainingSetup(precision="bf16", optimizer="adamw", zero_stage=stage, world_size=64))
    assert round(est.total / GB, 1) == expected_gb


def test_mixed_precision_adam_is_16_bytes_per_param():
    est = estimate(1e9, TrainingSetup(precision="bf16", optimizer="adamw"))
    assert (est.parameters, est.gradients, est.optimizer) == (2e9, 2e9, 12e9)


@pytest.mark.parametrize("optimizer, bytes_per_param", [
    ("sgd", 8), ("sgd-momentum", 12), ("adamw", 16), ("lion", 12), ("adamw-8bit", 10 + 8 / 256),
])
def test_optimizers_per_param_mixed_precision(optimizer, bytes_per_param):
    # Transformer Math 101: master copy 4 + momentum 4 (SGD+momentum: 8 in the optimizer), 8-bit Adam 6.
    est = estimate(1e6, TrainingSetup(precision="bf16", optimizer=optimizer))
    assert est.total == pytest.approx(bytes_per_param * 1e6)


def test_fp32_adamw_counts_torch_step_tensors_when_shape_known():
    shape = ModelShape(100, 32, 64, 2, 4, 2)
    est = estimate(shape, TrainingSetup(precision="fp32", optimizer="adamw"))
    n_tensors = len(shape.param_tensor_shapes())
    assert est.optimizer == 8 * shape.num_params + 4 * n_tensors


def test_adafactor_factors_matrices():
    shape = ModelShape(100, 32, 64, 1, 4, 2)
    est = estimate(shape, TrainingSetup(precision="fp32", optimizer="adafactor"))
    expected = sum((s[0] + s[1]) * 4 if len(s) == 2 else s[0] * 4 for s in shape.param_tensor_shapes())
    assert est.optimizer == expected + 4 * len(shape.param_tensor_shapes())
    assert est.optimizer < 0.1 * estimate(shape, TrainingSetup(precision="fp32", optimizer="adamw")).optimizer


def test_zero_stages_shard_the_right_parts():
    base = estimate(1e9, TrainingSetup(world_size=8))
    s1 = estimate(1e9, TrainingSetup(zero_stage=1, world_size=8))
    s2 = estimate(1e9, TrainingSetup(zero_stage=2, world_size=8))
    s3 = estimate(1e9, TrainingSetup(zero_stage=3, world_size=8))
    assert s1.optimizer == base.optimizer / 8 and s1.gradients == base.gradients
    assert s2.gradients == base.gradients / 8 and s2.parameters == base.parameters
    assert s3.parameters == base.parameters / 8


def test_known_shapes_match_published_parameter_counts():
    # Llama 3 model cards: 1.24B (3.2-1B, tied), 8.03B, 70.6B
    assert KNOWN_SHAPES["llama3-1b"].num_params == 1_235_814_400
    assert KNOWN_SHAPES["llama3-8b"].num_params == 8_030_261_248
    assert KNOWN_SHAPES["llama3-70b"].num_params == 70_553_706_496


def test_model_shape_matches_transformers():
    transformers = pytest.importorskip("transformers")
    shape = ModelShape(300, 64, 160, 2, 4, 2)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape.to_config_kwargs()))
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    assert [tuple(p.shape) for p in model.parameters()] == shape.param_tensor_shapes()
    assert ModelShape.from_config(model.config) == shape


def test_kv_cache_formula_llama3_8b():
    # 2 (K,V) x 32 layers x 8 kv heads x 128 head dim x 2 bytes = 128 KiB per token
    est = estimate(KNOWN_SHAPES["llama3-8b"], TrainingSetup(kv_cache_len=8192, kv_cache_batch=1))
    assert est.kv_cache == 131072 * 8192


def test_activations_grow_quadratically_only_with_eager_attention():
    shape = KNOWN_SHAPES["llama3-1b"]

    def acts(seq, attention):
        return estimate(shape, TrainingSetup(seq_len=seq, attention=attention)).activations

    assert acts(4096, "sdpa") / acts(2048, "sdpa") == pytest.approx(2, rel=0.01)
    assert acts(4096, "eager") / acts(2048, "eager") > 2.5


def test_checkpointing_saves_activation_memory():
    shape = KNOWN_SHAPES["llama3-8b"]
    full = estimate(shape, TrainingSetup(seq_len=4096)).activations
    ckpt = estimate(shape, TrainingSetup(seq_len=4096, checkpointing=True)).activations
    # the checkpointed peak comes at the start of backward, where the loss's two fp32 gradients of
    # 4096 x 128,256 values (4.2 GB) sit on top of the segment inputs and the head
    assert ckpt < full / 3
    terms = activation_terms(shape, TrainingSetup(seq_len=4096, checkpointing=True))
    assert terms.phase == "start of backward" and ckpt == round(terms.start_of_backward)
    assert terms.loss_gradients == 2 * 4 * 4096 * 128_256


def test_qlora_bits_per_parameter():
    # QLoRA: double quantization cuts the constants from 0.5 to 0.127 bits per parameter
    assert (quantized_bytes_per_param("nf4", False) * 8 - 4) == pytest.approx(0.5)
    assert (quantized_bytes_per_param("nf4", True) * 8 - 4) == pytest.approx(0.127, abs=1e-3)


def test_lora_trains_only_adapters():
    shape = KNOWN_SHAPES["llama3-8b"]
    est = estimate(shape, TrainingSetup(lora_rank=16, lora_targets=("q_proj", "v_proj")))
    # per layer: A (16 x 4096) + B (4096 x 16) for q, A (16 x 4096) + B (1024 x 16) for v
    assert est.trainable_params == 32 * 16 * (4096 + 4096 + 4096 + 1024)
    assert est.gradients == 2 * est.trainable_params
    qlora = estimate(shape, TrainingSetup(lora_rank=16, quantization="nf4"))
    assert qlora.parameters < 0.4 * estimate(shape, TrainingSetup()).parameters


@pytest.mark.parametrize("kwargs", [
    {"zero_stage": 4}, {"world_size": 0}, {"optimizer": "adamax"}, {"precision": "fp8"},
    {"seq_len": -1}, {"attention": "flash"}, {"quantization": "nf3"}, {"lora_targets": ("wq",)},
    {"torch_version": "latest"}, {"torch_version": "2"},
])
def test_bad_setups_are_rejected(kwargs):
    with pytest.raises(ValueError):
        TrainingSetup(**kwargs)


def test_count_only_rejects_what_needs_shapes():
    with pytest.raises(ValueError, match="shape"):
        estimate(1e9, TrainingSetup(lora_rank=8))
    with pytest.raises(ValueError):
        estimate(-5, TrainingSetup())


def test_checkpoint_segments_keep_inputs_and_recompute_one_segment():
    shape = KNOWN_SHAPES["llama3-8b"]  # 32 layers
    terms = {k: activation_terms(shape, TrainingSetup(seq_len=4096, checkpointing=True, checkpoint_every=k))
             for k in (1, 2, 4, 8, 16, 32)}
    i_bytes = 4096 * shape.hidden_size * 2  # one sequence's hidden states in bf16
    one = terms[1]
    for k, t in terms.items():
        # what is saved (forward + one recomputed segment): ceil(32 / k) inputs + k layers + the rest
        assert t.saved == pytest.approx(-(-32 // k) * i_bytes + k * one.layer + one.head + one.shared, abs=2)
        # the start of backward loses an input per segment fewer; the recomputed segment gains a layer per layer
        assert one.start_of_backward - t.start_of_backward == pytest.approx((32 - -(-32 // k)) * i_bytes, abs=2)
        assert t.backward_of_layers - one.backward_of_layers == pytest.approx(
            (k - 1) * one.layer - (32 - -(-32 // k)) * i_bytes, abs=2)
        # the calculator reports the larger phase, not the sum
        est = estimate(shape, TrainingSetup(seq_len=4096, checkpointing=True, checkpoint_every=k)).activations
        assert est == round(max(t.start_of_backward, t.backward_of_layers, t.end_of_forward))
    # a Llama layer saves ~25x its input, so the layers' phase is smallest for per-layer segments (the
    # sqrt(n) rule assumes a layer saves about as much as its input) ...
    assert min(terms, key=lambda k: terms[k].backward_of_layers) == 1 and one.layer > 20 * i_bytes
    # ... but with Llama-3's vocabulary the loss's gradients set the peak up to k = 8
    assert [t.phase for t in terms.values()] == ["start of backward"] * 3 + ["backward of the layers"] * 3
    assert estimate(shape, TrainingSetup(seq_len=4096, checkpointing=True)).activations == round(one.peak)
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainingSetup(checkpointing=True, checkpoint_every=0)


def test_lomo_keeps_no_state_and_one_tensor_of_gradients():
    shape = KNOWN_SHAPES["llama3-8b"]
    lomo = estimate(shape, TrainingSetup(precision="bf16-pure", optimizer="lomo"))
    largest = max(math.prod(t) for t in shape.param_tensor_shapes())
    assert lomo.optimizer == 0 and lomo.gradients == 2 * largest
    assert lomo.gradients < estimate(shape, TrainingSetup(precision="bf16-pure", optimizer="sgd")).gradients / 10
    assert estimate(8e9, TrainingSetup(optimizer="lomo")).gradients == 0  # no shapes: nothing to size it by


def test_activations_plus_backward_extra_is_the_activation_peak():
    """Without checkpointing `activations` is what forward saves; `backward_extra` brings it up to the
    activations' peak (the start of backward: the loss's two fp32 gradients); with it the extra is 0."""
    from gpulab.memory import KNOWN_SHAPES, TrainingSetup, activation_terms, estimate

    shape = KNOWN_SHAPES["llama3-8b"]
    for checkpointing in (False, True):
        setup = TrainingSetup(precision="bf16", seq_len=4096, checkpointing=checkpointing)
        est = estimate(shape, setup)
        terms = activation_terms(shape, setup)
        assert est.activations + est.backward_extra == round(terms.peak) or \
            abs(est.activations + est.backward_extra - terms.peak) <= 1
        assert (est.backward_extra == 0) == checkpointing
        if not checkpointing:
            assert abs(est.activations - terms.saved) <= 1, "what forward saves"
    plain = estimate(shape, TrainingSetup(precision="bf16", seq_len=4096))
    loss_gradients = 2 * 4 * 4096 * shape.vocab_size
    assert 0.99 * loss_gradients < plain.backward_extra <= loss_gradients


def test_torch_version_reads_a_version_string():
    from gpulab.memory.calculator import torch_minor

    assert torch_minor("2.15.0+cu132") == torch_minor("2.15") == (2, 15)
    assert torch_minor("2.9.1") < torch_minor("2.13") < torch_minor("2.15.0")


def test_fsdp2_zero2_of_torch_215_holds_one_all_gather_buffer_less_in_forward():
    """Up to torch 2.14 FSDP2's forward holds the layer below's all-gather buffer while a layer copies out
    of its own; 2.15 frees it first (tests/test_fsdp_peak.py measures the installed one). Where that copy is the
    ZeRO-2 peak, 2.15's peak is one layer's parameters lower, and the older count's note gives it."""
    shape = ModelShape(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4,
                       num_kv_heads=2)
    setup = TrainingSetup(precision="fp32", zero_stage=2, world_size=4, batch_size=1, seq_len=64)
    old, new = estimate(shape, setup), estimate(shape, dataclasses.replace(setup, torch_version="2.15.0+cu132"))
    layer_bytes = 4 * (shape.layer_linear_params() + 2 * shape.hidden_size)
    assert 0 < old.fsdp2_zero2_peak - new.fsdp2_zero2_peak <= layer_bytes
    assert any(f"peak {new.fsdp2_zero2_peak / 1e9:.3f} GB there" in n for n in old.notes)
    assert not any("torch 2.15" in n for n in new.notes)
    # the DeepSpeed count, ZeRO-3 and a step without FSDP2 do not depend on it
    for stage in (0, 2, 3):
        a = estimate(shape, dataclasses.replace(setup, zero_stage=stage))
        b = estimate(shape, dataclasses.replace(setup, zero_stage=stage, torch_version="2.15"))
        assert (a.peak, a.total) == (b.peak, b.total)
