"""Models from presets (random init, no download) and the opt-in loader of real checkpoints."""

import torch

from gpulab.models import build_model, load_pretrained
from gpulab.presets import PRESETS


def test_tiny_preset_builds_with_its_parameter_count():
    shape = PRESETS["tiny"].shape
    model = build_model(shape)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
    assert model.training and next(model.parameters()).dtype == torch.float32


def test_build_is_seeded_and_honours_dtype():
    shape = PRESETS["tiny"].shape
    a, b = build_model(shape, seed=1), build_model(shape, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model(shape, seed=2)
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters())), "another seed, other weights"
    assert next(build_model(shape, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_load_pretrained_reads_a_local_safetensors_checkpoint(tmp_path):
    model = build_model(PRESETS["tiny"].shape, seed=2)
    model.save_pretrained(tmp_path)  # safetensors by default; no hub involved
    assert (tmp_path / "model.safetensors").exists()
    loaded = load_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 100, (1, 8))
    model.eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
