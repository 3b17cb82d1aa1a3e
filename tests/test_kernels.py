"""The fused SwiGLU kernels: CUDA source compiled without a GPU (NVRTC; nvcc when present), the CPU
kernel and the Triton kernel (interpreted) against eager, and dropping a kernel into a Llama model."""

import os
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest
import torch

from gpulab.kernels import (check_cuda_sources, fuse_swiglu, load_cpu, nvrtc, source, swiglu_backward_reference,
                            swiglu_eager, swiglu_fused)
from gpulab.kernels.build import CUDA_ARCHS, KERNEL_DIR, cuda_kernel_names, ensure_ninja, extension_name
from gpulab.models import build_model
from gpulab.presets import PRESETS
from gpulab.profiling import kernels

TORCH_INCLUDE = [str(Path(torch.__file__).parent / "include"),
                 str(Path(torch.__file__).parent / "include" / "torch" / "csrc" / "api" / "include")]
needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed (Linux: nvidia-cuda-nvrtc)")


# GPUs readers run the labs on beyond the course's A100/H100 targets: Colab's T4 (sm_75), A10 and RTX 30
# (sm_86), L4 and RTX 40 (sm_89), B200 (sm_100), RTX 50 (sm_120). On a GPU, load_inline builds for that GPU.
OTHER_CUDA_ARCHS = ("sm_75", "sm_86", "sm_89", "sm_100", "sm_120")


@needs_nvrtc
@pytest.mark.parametrize("archs", [None, OTHER_CUDA_ARCHS], ids=["course targets", "other GPUs"])
def test_nvrtc_compiles_every_launched_instance_for_each_arch(archs):
    results = check_cuda_sources() if archs is None else check_cuda_sources(archs=archs)
    assert [r.arch for r in results] == list(archs or CUDA_ARCHS)
    for r in results:
        assert r.ok, f"{r.arch}: {r.log}"
        assert set(r.lowered_names) == set(cuda_kernel_names()) and r.cubin_bytes > 0


@needs_nvrtc
def test_nvrtc_reports_errors_with_line_numbers():
    broken = source("swiglu_kernels.cuh").replace("expf(-x)", "expf(-x", 1)
    (result,) = check_cuda_sources(archs=("sm_90",), kernel_source=broken)
    assert not result.ok and "swiglu_kernels.cuh(" in result.log and "error" in result.log


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_compiles_the_host_code_against_torch_headers(tmp_path):
    # The CPU wheel of torch ships c10/cuda headers but not the one CMake generates for CUDA builds.
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in CUDA_ARCHS]
    cmd = ["nvcc", "-c", "-std=c++20", "-O1", *gencode, f"-I{tmp_path / 'stub'}", *(f"-I{p}" for p in TORCH_INCLUDE),
           f"-I{KERNEL_DIR}", *nvrtc.TORCH_NVCC_DEFINES, "--expt-relaxed-constexpr",
           str(KERNEL_DIR / "swiglu_cuda.cu"), "-o", str(tmp_path / "swiglu_cuda.o")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def cuda_toolkit_home() -> Path | None:
    """The CUDA toolkit to link against: $CUDA_HOME, else nvcc's own folder (a `/usr/local/bin/nvcc` that
    wraps `/usr/local/cuda-13.0/bin/nvcc` would make torch look for libcudart in /usr/local)."""
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(1, str(Path(nvcc).resolve().parent.parent))
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists() and any(Path(home).glob("lib*/libcudart.so*")):
            return Path(home)
    return None


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch: no CUDA libraries to link against")
@pytest.mark.skipif(cuda_toolkit_home() is None, reason="no CUDA toolkit (nvcc and libcudart) found")
def test_cuda_extension_builds_links_and_loads_against_this_torch(tmp_path, monkeypatch):
    # What lab 4's load_cuda does on the GPU machine, up to the first launch: with the gpu-image
    # environment's torch (2.11, CUDA 13.0 build) a compile or link error shows here, not on the GPU.
    import torch.utils.cpp_extension as cpp_extension

    from gpulab.kernels.build import build_cuda

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(cuda_toolkit_home()))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # H100 and H200: one architecture keeps it short
    build_cuda()
    with pytest.raises(RuntimeError, match="gate must be a CUDA tensor"):  # the refusal raises, no crash
        torch.ops.gpulab_cuda.swiglu_forward(torch.ones(2, 8), torch.ones(2, 8))


def test_each_torch_version_builds_in_its_own_folder(monkeypatch):
    # torch 2.14+ leaves a build folder's `lock` file behind, and torch 2.13 and earlier wait while it
    # exists: in a shared folder (same Python and CUDA tags, e.g. torch 2.14.1 and 2.13.0 on CUDA 13.0)
    # the older one's build hung (seen with the environments of README's `make test-gpu-image`)
    names = set()
    for version in ("2.13.0+cu130", "2.14.1+cu130", "2.13.0+cpu"):
        monkeypatch.setattr(torch, "__version__", version)
        names.add(extension_name("gpulab_swiglu_cpu"))
    assert len(names) == 3 and all(name.isidentifier() for name in names), names


def test_cuda_operator_registration_compiles():
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-fsyntax-only", "-std=c++20", *(f"-isystem{p}" for p in TORCH_INCLUDE),
           f"-I{sysconfig.get_paths()['include']}", str(KERNEL_DIR / "swiglu_cuda_ops.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def test_ensure_ninja_finds_the_wheels_binary_off_path(monkeypatch, tmp_path):
    # torch's cpp_extension runs `ninja` from PATH; `.venv/bin/python -m pytest` (make test) runs without
    # the venv's bin on PATH, where the ninja wheel put its binary
    pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no ninja, no OS one either
    found = ensure_ninja()
    assert shutil.which("ninja") == found
    assert subprocess.run([found, "--version"], capture_output=True).returncode == 0


def test_ensure_ninja_finds_the_binary_of_a_target_install(monkeypatch, tmp_path):
    # `pip install --target site` (tools/gpu-run.sh, with the carried wheels) puts the binary in site/bin,
    # where ninja.BIN_DIR does not look: it is "" there
    package = tmp_path / "site" / "ninja"
    package.mkdir(parents=True)
    binary = tmp_path / "site" / "bin" / "ninja"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\necho 1.13.2\n")
    binary.chmod(0o755)
    fake = types.ModuleType("ninja")
    fake.BIN_DIR = ""  # type: ignore[attr-defined]
    fake.__file__ = str(package / "__init__.py")
    monkeypatch.setitem(sys.modules, "ninja", fake)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert ensure_ninja() == str(binary.resolve())
    assert shutil.which("ninja") == str(binary.resolve())


def test_ensure_ninja_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ninja", None)  # `import ninja` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip install ninja"):
        ensure_ninja()


@pytest.fixture(scope="module")
def cpu_kernels():
    return load_cpu()


@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 1000, 17), (4096,)])
def test_cpu_kernel_matches_eager_forward_and_backward(cpu_kernels, shape):
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(shape, generator=gen) * 4 for _ in range(3))
    torch.testing.assert_close(cpu_kernels.forward(gate, up), swiglu_eager(gate, up))
    d_gate, d_up = cpu_kernels.backward(grad, gate, up)
    ref_gate, ref_up = swiglu_backward_reference(grad, gate, up)
    torch.testing.assert_close(d_gate, ref_gate)
    torch.testing.assert_close(d_up, ref_up)


def test_fused_autograd_matches_eager_on_non_contiguous_inputs(cpu_kernels):
    base = torch.randn(64, 48)
    gate, up = base.t().clone().requires_grad_(), torch.randn(48, 64).requires_grad_()
    g_view, u_view = gate[:, ::2], up[:, ::2]  # strided views: swiglu_fused makes them contiguous
    grad = torch.randn(48, 32)
    fused = torch.autograd.grad(swiglu_fused(g_view, u_view, cpu_kernels), (gate, up), grad)
    eager = torch.autograd.grad(swiglu_eager(g_view, u_view), (gate, up), grad)
    for f, e in zip(fused, eager):
        torch.testing.assert_close(f, e)


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided"])
def test_cpu_kernel_refuses_bad_inputs(cpu_kernels, bad):
    x = torch.randn(8, 8)
    args = {"shape": (x, x[:4]), "dtype": (x.double(), x.double()), "strided": (x.t(), x)}[bad]
    with pytest.raises(RuntimeError, match="swiglu \\(CPU\\)"):
        cpu_kernels.forward(*args)


def test_fused_ops_count_one_kernel_each_way(cpu_kernels):
    gate, up = torch.randn(100, requires_grad=True), torch.randn(100, requires_grad=True)
    assert kernels(lambda: swiglu_eager(gate, up), "cpu") == ["aten::silu", "aten::mul"]
    assert kernels(lambda: swiglu_fused(gate, up, cpu_kernels), "cpu") == ["gpulab_cpu::swiglu_forward"]
    out, grad = swiglu_fused(gate, up, cpu_kernels), torch.ones(100)
    assert kernels(lambda: torch.autograd.grad(out, (gate, up), grad), "cpu") == ["gpulab_cpu::swiglu_backward"]


def test_fuse_swiglu_keeps_the_model_output(cpu_kernels):
    shape = PRESETS["tiny"].shape
    eager, fused = build_model(shape, seed=3), build_model(shape, seed=3)
    assert fuse_swiglu(fused, cpu_kernels) == shape.num_layers
    ids = torch.randint(3, shape.vocab_size, (2, 16))
    loss_e, loss_f = eager(input_ids=ids, labels=ids).loss, fused(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss_f, loss_e)
    loss_e.backward()
    loss_f.backward()
    for (name, pe), pf in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(pf.grad, pe.grad, msg=name)


def test_fuse_swiglu_refuses_models_without_a_silu_mlp(cpu_kernels):
    with pytest.raises(ValueError, match="no Llama-style MLP"):
        fuse_swiglu(torch.nn.Linear(4, 4), cpu_kernels)
    model = build_model(PRESETS["tiny"].shape)
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="not SiLU"):
        fuse_swiglu(model, cpu_kernels)


@pytest.mark.skipif(sys.platform != "linux", reason="Triton has Linux wheels only")
def test_triton_kernels_compile_for_each_gpu_generation():
    # The interpreter runs the kernels' Python with NumPy and forgives what the compiler does not (types,
    # layouts): compile both in each dtype lab 4 uses, ahead of time, no GPU needed, for the H100 and H200
    # (sm_90), the A100 (sm_80) and the other GPUs of OTHER_CUDA_ARCHS.
    capabilities = [int(arch[3:]) for arch in (*CUDA_ARCHS, *OTHER_CUDA_ARCHS)]
    script = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from gpulab.kernels import swiglu_triton as st\n"
        f"for capability, dtype in [(c, d) for c in {capabilities} for d in ('fp32', 'bf16', 'fp16')]:\n"
        "    for kernel, pointers in ((st.swiglu_forward_kernel, 3), (st.swiglu_backward_kernel, 5)):\n"
        "        names = kernel.arg_names\n"
        "        signature = {**{a: '*' + dtype for a in names[:pointers]}, 'n': 'i32', 'BLOCK': 'constexpr'}\n"
        "        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={'BLOCK': st.BLOCK}),\n"
        "                                  target=GPUTarget('cuda', capability, 32))\n"
        "        assert len(compiled.asm['cubin']) > 0\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(sys.platform != "linux", reason="Triton has Linux wheels only")
def test_triton_kernel_matches_eager_under_the_interpreter():
    # TRITON_INTERPRET must be set before triton is imported: a fresh interpreter
    script = (
        "import torch\n"
        "from gpulab.kernels import swiglu_triton as st, swiglu_eager, swiglu_backward_reference\n"
        "g, u, dy = (torch.randn(3000) for _ in range(3))\n"
        "torch.testing.assert_close(st.swiglu_forward(g, u), swiglu_eager(g, u))\n"
        "for a, b in zip(st.swiglu_backward(dy, g, u), swiglu_backward_reference(dy, g, u)):\n"
        "    torch.testing.assert_close(a, b)\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
