// Registers the CUDA kernels of swiglu_cuda.cu as PyTorch operators (compiled by the host C++ compiler,
// not nvcc): torch.ops.gpulab_cuda.swiglu_forward(gate, up) and swiglu_backward(grad, gate, up).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad, const at::Tensor& gate,
                                                       const at::Tensor& up);

TORCH_LIBRARY(gpulab_cuda, m) {
  m.def("swiglu_forward", &swiglu_forward_cuda);
  m.def("swiglu_backward", &swiglu_backward_cuda);
}
