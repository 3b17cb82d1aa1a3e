// Fused SwiGLU for CUDA: out = silu(gate) * up, with silu(x) = x * sigmoid(x), and its backward.
//
// Device code only (no torch headers), so that NVRTC can compile it without a GPU and the same text is
// what `load_inline` builds on one. Elementwise ops are memory-bound: the whole game is to read each
// input once and write each output once. Eager PyTorch runs silu and mul as two kernels and writes the
// intermediate silu(gate) to global memory and reads it back; here it stays in a register.
//
// Each thread handles VEC consecutive elements: VEC * sizeof(T) = 16 bytes, one 128-bit load per input,
// the widest a thread can issue before Blackwell (sm_100 has 256-bit loads). The host picks VEC = 1 for unaligned data.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace gpulab {

// Explicit conversions: PyTorch builds extensions with -D__CUDA_NO_HALF_CONVERSIONS__ and
// -D__CUDA_NO_BFLOAT16_CONVERSIONS__, which turn off the implicit ones.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// VEC elements that move as one aligned load or store.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out[i] = silu(gate[i]) * up[i]; math in fp32 whatever T is.
template <typename T, int VEC>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                      T* __restrict__ out, long long n) {
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (first + VEC <= n) {
    const Pack<T, VEC> g = *reinterpret_cast<const Pack<T, VEC>*>(gate + first);
    const Pack<T, VEC> u = *reinterpret_cast<const Pack<T, VEC>*>(up + first);
    Pack<T, VEC> o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float x = to_float(g.v[k]);
      o.v[k] = from_float<T>(x * sigmoid(x) * to_float(u.v[k]));
    }
    *reinterpret_cast<Pack<T, VEC>*>(out + first) = o;
  } else {
    // the last thread: fewer than VEC elements left
    for (long long i = first; i < n; ++i) {
      const float x = to_float(gate[i]);
      out[i] = from_float<T>(x * sigmoid(x) * to_float(up[i]));
    }
  }
}

// d_gate = grad * up * s * (1 + x * (1 - s)) with s = sigmoid(x), x = gate;  d_up = grad * x * s.
// Recomputing s costs a few instructions and saves storing silu(gate) for backward.
template <typename T, int VEC>
__global__ void swiglu_backward_kernel(const T* __restrict__ grad, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ d_gate,
                                       T* __restrict__ d_up, long long n) {
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (first + VEC <= n) {
    const Pack<T, VEC> dy = *reinterpret_cast<const Pack<T, VEC>*>(grad + first);
    const Pack<T, VEC> g = *reinterpret_cast<const Pack<T, VEC>*>(gate + first);
    const Pack<T, VEC> u = *reinterpret_cast<const Pack<T, VEC>*>(up + first);
    Pack<T, VEC> dg, du;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float x = to_float(g.v[k]), s = sigmoid(x), d = to_float(dy.v[k]);
      dg.v[k] = from_float<T>(d * to_float(u.v[k]) * s * (1.0f + x * (1.0f - s)));
      du.v[k] = from_float<T>(d * x * s);
    }
    *reinterpret_cast<Pack<T, VEC>*>(d_gate + first) = dg;
    *reinterpret_cast<Pack<T, VEC>*>(d_up + first) = du;
  } else {
    for (long long i = first; i < n; ++i) {
      const float x = to_float(gate[i]), s = sigmoid(x), d = to_float(grad[i]);
      d_gate[i] = from_float<T>(d * to_float(up[i]) * s * (1.0f + x * (1.0f - s)));
      d_up[i] = from_float<T>(d * x * s);
    }
  }
}

}  // namespace gpulab
