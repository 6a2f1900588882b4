// Element-wise y = a * x + b, five ways: the same arithmetic, different widths of
// memory access per thread.
//
//   kernel               dtype  elements per thread  bytes per load
//   axpb_f32_kernel      fp32   1                    4
//   axpb_f32x4_kernel    fp32   4 (one float4)       16
//   axpb_f16_kernel      fp16   1                    2
//   axpb_f16x2_kernel    fp16   2 (one __half2)      4
//   axpb_f16x8_kernel    fp16   8 (four __half2)     16
//
// Traffic: read n elements, write n elements; no element is touched twice. The
// arithmetic is done in fp32 for every dtype (it is free in a memory-bound kernel)
// and rounded once when stored.
//
// Vector variants need x and y aligned to the vector width (16 bytes for float4 and
// the 8-half vector, 4 bytes for __half2); the Python wrapper checks x, and y is
// freshly allocated (PyTorch aligns new tensors to at least 256 bytes).
// The n % width elements left over after the last full vector are done one per
// thread by the first threads of the grid.

#include <cstdint>

#include <cuda_fp16.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

namespace llmnote_ew {

constexpr int kThreads = 256;  // threads per block for every variant

__global__ void axpb_f32_kernel(const float* __restrict__ x, float* __restrict__ y, float a,
                                float b, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaf(a, x[i], b);
}

__global__ void axpb_f32x4_kernel(const float* __restrict__ x, float* __restrict__ y, float a,
                                  float b, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t nvec = n / 4;
  if (i < nvec) {
    float4 v = reinterpret_cast<const float4*>(x)[i];  // one 16-byte load (LDG.E.128)
    v.x = fmaf(a, v.x, b);
    v.y = fmaf(a, v.y, b);
    v.z = fmaf(a, v.z, b);
    v.w = fmaf(a, v.w, b);
    reinterpret_cast<float4*>(y)[i] = v;  // one 16-byte store
  }
  int64_t tail = nvec * 4 + i;  // the last n % 4 elements, one per thread
  if (i < n - nvec * 4) y[tail] = fmaf(a, x[tail], b);
}

__global__ void axpb_f16_kernel(const __half* __restrict__ x, __half* __restrict__ y, float a,
                                float b, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half_rn(fmaf(a, __half2float(x[i]), b));
}

__device__ __forceinline__ __half2 axpb_half2(__half2 h, float a, float b) {
  float2 f = __half22float2(h);
  return __floats2half2_rn(fmaf(a, f.x, b), fmaf(a, f.y, b));
}

__global__ void axpb_f16x2_kernel(const __half* __restrict__ x, __half* __restrict__ y, float a,
                                  float b, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t nvec = n / 2;
  if (i < nvec) {
    reinterpret_cast<__half2*>(y)[i] = axpb_half2(reinterpret_cast<const __half2*>(x)[i], a, b);
  }
  int64_t tail = nvec * 2 + i;
  if (i < n - nvec * 2) y[tail] = __float2half_rn(fmaf(a, __half2float(x[tail]), b));
}

__global__ void axpb_f16x8_kernel(const __half* __restrict__ x, __half* __restrict__ y, float a,
                                  float b, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t nvec = n / 8;
  if (i < nvec) {
    uint4 raw = reinterpret_cast<const uint4*>(x)[i];  // 16 bytes = 8 halves
    __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = axpb_half2(h[k], a, b);
    reinterpret_cast<uint4*>(y)[i] = raw;
  }
  int64_t tail = nvec * 8 + i;
  if (i < n - nvec * 8) y[tail] = __float2half_rn(fmaf(a, __half2float(x[tail]), b));
}

}  // namespace llmnote_ew

// y = a * x + b for a contiguous fp32 or fp16 CUDA tensor x; width = elements per
// thread access (fp32: 1 or 4; fp16: 1, 2 or 8).
torch::Tensor axpb(torch::Tensor x, double a, double b, int64_t width) {
  using namespace llmnote_ew;
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), "axpb: x must be a contiguous CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return y;
  // threads needed: one per full vector, and at least one per leftover element
  const int64_t threads = std::max<int64_t>(n / width, n % width);
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "axpb: too many elements for a 1-D grid");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float fa = static_cast<float>(a), fb = static_cast<float>(b);
  if (x.scalar_type() == torch::kFloat32) {
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (width == 1) {
      axpb_f32_kernel<<<blocks, kThreads, 0, stream>>>(xp, yp, fa, fb, n);
    } else if (width == 4) {
      axpb_f32x4_kernel<<<blocks, kThreads, 0, stream>>>(xp, yp, fa, fb, n);
    } else {
      TORCH_CHECK(false, "axpb: fp32 supports width 1 or 4, got ", width);
    }
  } else if (x.scalar_type() == torch::kFloat16) {
    const __half* xp = reinterpret_cast<const __half*>(x.data_ptr<at::Half>());
    __half* yp = reinterpret_cast<__half*>(y.data_ptr<at::Half>());
    if (width == 1) {
      axpb_f16_kernel<<<blocks, kThreads, 0, stream>>>(xp, yp, fa, fb, n);
    } else if (width == 2) {
      axpb_f16x2_kernel<<<blocks, kThreads, 0, stream>>>(xp, yp, fa, fb, n);
    } else if (width == 8) {
      axpb_f16x8_kernel<<<blocks, kThreads, 0, stream>>>(xp, yp, fa, fb, n);
    } else {
      TORCH_CHECK(false, "axpb: fp16 supports width 1, 2 or 8, got ", width);
    }
  } else {
    TORCH_CHECK(false, "axpb: x must be float32 or float16, got ", x.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}
