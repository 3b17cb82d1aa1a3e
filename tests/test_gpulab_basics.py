"""Unit tests for gpulab's small modules: environment, presets, data, timing, checks, reports."""

from types import SimpleNamespace

import pytest
import torch

from gpulab import checks, env, hardware, presets, report, timing
from gpulab.data import IGNORE_INDEX, TASKS, encode, load_task, make_examples, train_tokenizer


def test_pick_device_prefers_gpu_then_mps_then_cpu(monkeypatch):
    # fake what torch sees, so the order is checked on any machine
    monkeypatch.delenv("GPULAB_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert env.pick_device().type == "cuda"
    assert env.pick_device("cpu").type == "cpu"  # asked for, even with a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert env.pick_device().type == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert env.pick_device().type == "cpu"


def test_pick_device_explains_a_device_it_cannot_give(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for asked, says in (("cuda", "no CUDA GPU"), ("mps", "no Apple GPU"), ("tpu", "use cpu, cuda")):
        monkeypatch.setenv("GPULAB_DEVICE", asked)
        with pytest.raises((RuntimeError, ValueError), match=says):
            env.pick_device()


def test_banner_names_device_and_versions():
    text = env.banner(torch.device("cpu"))
    assert text.startswith("device: cpu") and "torch " in text and "transformers " in text


def test_native_bf16_needs_compute_capability_8(monkeypatch):
    assert env.native_bf16(torch.device("cpu"))  # slow on some CPUs, but native: nothing emulated
    monkeypatch.setattr(torch.version, "hip", None)
    seen = []

    def capability(device):
        seen.append(device)
        return {0: (7, 5), 1: (8, 0), 2: (9, 0)}[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    # a T4 (7.5) emulates bf16; an A100 (8.0) and an H100 (9.0) have bf16 tensor cores
    assert [env.native_bf16(torch.device("cuda", i)) for i in range(3)] == [False, True, True]
    assert [d.index for d in seen] == [0, 1, 2]  # asks about the device it is given
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert env.native_bf16(torch.device("cuda", 0))  # ROCm: every supported AMD GPU computes bf16


def test_require_memory_stops_before_cuda_does(monkeypatch):
    env.require_memory(1e15, torch.device("cpu"), "anything")  # a CPU: nothing to check against
    monkeypatch.setattr(env, "device_memory_bytes", lambda device: 80 * 10**9)
    env.require_memory(70e9, torch.device("cpu"), "a step")  # under 90% of 80 GB
    with pytest.raises(MemoryError, match="a step needs about 75 GB.*GPULAB_PRESET=small"):
        env.require_memory(75e9, torch.device("cpu"), "a step")


def test_seed_everything_repeats():
    env.seed_everything(3)
    a = torch.rand(3)
    env.seed_everything(3)
    assert torch.equal(a, torch.rand(3))


def test_presets_env_override_and_errors(monkeypatch):
    monkeypatch.delenv(presets.ENV_VAR, raising=False)
    assert presets.get_preset(device=torch.device("cpu")).name == "tiny"
    assert presets.get_preset(device=torch.device("cuda")).name == "small"
    monkeypatch.setenv(presets.ENV_VAR, "tiny")
    assert presets.get_preset(device=torch.device("cuda")).name == "tiny"
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        presets.get_preset("huge")


def test_auto_preset_falls_back_to_tiny_on_a_small_gpu(monkeypatch, capsys):
    monkeypatch.delenv(presets.ENV_VAR, raising=False)
    cuda = torch.device("cuda")
    monkeypatch.setattr(env, "device_memory_bytes", lambda device: 12_884_901_888)  # 12,288 MiB
    assert presets.get_preset(device=cuda).name == "tiny"
    assert "12.9 GB, less than the 14 GB" in capsys.readouterr().out
    assert presets.get_preset("small", device=cuda).name == "small"  # asked for by name: no fallback
    monkeypatch.setattr(env, "device_memory_bytes", lambda device: 16_106_127_360)  # a T4, 15,360 MiB
    assert presets.get_preset(device=cuda).name == "small"
    assert capsys.readouterr().out == ""


def test_examples_are_deterministic_and_correct():
    examples = make_examples(50, seed=1)
    assert examples == make_examples(50, seed=1) and examples != make_examples(50, seed=2)
    for ex in examples:
        task, letters = ex.instruction.split(": ")
        assert " ".join(TASKS[task](letters.split())) == ex.response


def test_encode_masks_prompt_and_padding():
    examples = make_examples(20)
    tok = train_tokenizer(examples, vocab_size=300)
    data = encode(examples, tok, seq_len=48)
    ids, labels, mask = data["input_ids"], data["labels"], data["attention_mask"]
    assert ids.shape == labels.shape == mask.shape == (20, 48)
    assert (labels[mask == 0] == IGNORE_INDEX).all()
    first = labels[0][labels[0] != IGNORE_INDEX]
    assert tok.decode(first[:-1]) == examples[0].response and first[-1] == tok.eos_token_id


def test_task_batches_have_shape():
    task = load_task(seq_len=32, n_train=64, n_eval=8)
    batch = next(task.batches(8))
    assert batch["input_ids"].shape == (8, 32)


def test_benchmark_reports_median(monkeypatch):
    # a fake clock: the repeats take 1, 1, 1, 1 and 100 ms, so the median (1) is far from the mean (20.8)
    ticks = iter([t for i, ms in enumerate([1, 1, 1, 1, 100]) for t in (i, i + ms / 1e3)])
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    calls = []
    t = timing.benchmark(lambda: calls.append(1), warmup=2, repeats=5)
    assert len(calls) == 7 and t.repeats == 5
    assert t.median_ms == pytest.approx(1.0) and t.min_ms == pytest.approx(1.0) and t.max_ms == pytest.approx(100.0)
    with pytest.raises(ValueError):
        timing.benchmark(lambda: None, repeats=0)


def test_check_prints_verdict_and_raises(capsys):
    checks.check(True, "works", measured="1.0 ms")
    assert capsys.readouterr().out == "PASS: works [measured: 1.0 ms]\n"
    with pytest.raises(AssertionError, match="FAIL: broken"):
        checks.check(False, "broken")


def test_markdown_table():
    text = report.markdown_table([{"a": 1, "b": 2.5}, {"a": 1234567, "b": "x"}], title="T")
    assert "| a | b |" in text and "| 1,234,567 | x |" in text and text.startswith("**T**")


def test_spec_peaks_and_cache(tmp_path, monkeypatch):
    assert hardware.spec_peak("NVIDIA H200").mem_bandwidth_gbs == 4800
    # sold in binary units: a "24 GB" card holds 25.8e9 bytes, an "80GB" H100 85.5e9
    assert round(hardware.gpu_memory_bytes("RTX 4090") / 1e9, 1) == 25.8
    assert round(hardware.gpu_memory_bytes("H100 80GB") / 1e9, 1) == 85.5
    assert round(hardware.gpu_memory_bytes("H200") / 2**30, 1) == 140.4
    # torch's names for the H100 family: PCIe and NVL cards must not get the SXM peaks
    assert hardware.spec_peak("NVIDIA H100 80GB HBM3").mem_bandwidth_gbs == 3350
    assert hardware.spec_peak("NVIDIA H100 PCIe").bf16_tflops == 756
    assert hardware.spec_peak("NVIDIA H100 NVL").mem_bandwidth_gbs == 3900
    assert hardware.spec_peak("NVIDIA H200 NVL").bf16_tflops == 835
    assert hardware.spec_peak("NVIDIA A100-SXM4-40GB").mem_bandwidth_gbs == 1555
    assert hardware.spec_peak("NVIDIA A100-SXM4-80GB").mem_bandwidth_gbs == 2039
    assert hardware.spec_peak("NVIDIA A100 80GB PCIe").mem_bandwidth_gbs == 1935
    # the CUDA-core roof: an H100 SXM's ridge for fp32 elementwise math is 67e12 / 3.35e12 = 20 FLOP/B
    assert round(hardware.spec_peak("NVIDIA H100 80GB HBM3").fp32_tflops * 1e3 / 3350) == 20
    assert hardware.spec_peak("Tesla T4").bf16_tflops is None
    assert hardware.spec_peak("CPU") is None
    monkeypatch.setenv("GPULAB_CACHE", str(tmp_path))
    assert hardware.load_measured("cpu") is None
    hardware.save_measured("cpu", {"copy_gbs": 10.0})
    assert hardware.load_measured("cpu") == {"copy_gbs": 10.0}


def test_measurement_helpers_on_cpu():
    assert hardware.matmul_tflops(64, torch.float32, "cpu", repeats=2) > 0
    assert hardware.copy_bandwidth_gbs(1 << 16, "cpu", repeats=2) > 0
