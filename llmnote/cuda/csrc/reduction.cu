// Sum of an fp32 vector: the reduction ladder of Mark Harris, "Optimizing Parallel
// Reduction in CUDA" (NVIDIA, 2007), steps 1-7, then two steps used by every modern
// reduction: warp shuffles (8) and 16-byte loads (9).
//
//   step  kernel        what changes against the step before
//   1     reduce1       interleaved addressing; `tid % (2s) == 0` diverges in every warp
//   2     reduce2       strided index `2 s tid`: no divergence, but shared-memory bank conflicts
//   3     reduce3       sequential addressing `tid < s`: no conflicts; half the threads idle at load
//   4     reduce4       first add during the load: each thread reads two elements
//   5     reduce5       the last warp unrolled: 6 fewer __syncthreads()
//   6     reduce6<B>    complete unrolling, the block size a template parameter
//   7     reduce7<B>    several elements per thread: a grid-stride loop over a one-wave grid
//   8     reduce8<B>    warp shuffles (__shfl_down_sync) instead of shared memory
//   9     reduce9<B>    16-byte loads (float4), four of them in flight per thread
//
// Every kernel reads its `n` inputs once and writes one partial sum per block. The
// host launches it again on the partial sums until one value is left: steps 1-6 need
// ceil(log_{elements per block}(n)) launches; steps 7-9 run the first launch on one
// full wave of resident blocks and finish with a single block: two launches.

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

namespace llmnote_red {

// ---- step 1: interleaved addressing, divergent branch ------------------------------
__global__ void reduce1(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  extern __shared__ float sdata[];
  const unsigned tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  sdata[tid] = i < n ? in[i] : 0.0f;
  __syncthreads();
  for (unsigned s = 1; s < blockDim.x; s *= 2) {
    if (tid % (2 * s) == 0) sdata[tid] += sdata[tid + s];  // active threads: 0, 2s, 4s, ...
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 2: interleaved addressing, strided index ----------------------------------
__global__ void reduce2(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  extern __shared__ float sdata[];
  const unsigned tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  sdata[tid] = i < n ? in[i] : 0.0f;
  __syncthreads();
  for (unsigned s = 1; s < blockDim.x; s *= 2) {
    const unsigned index = 2 * s * tid;  // active threads are 0, 1, 2, ...: whole warps
    if (index < blockDim.x) sdata[index] += sdata[index + s];  // word stride 2s: conflicts
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 3: sequential addressing --------------------------------------------------
__global__ void reduce3(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  extern __shared__ float sdata[];
  const unsigned tid = threadIdx.x;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid;
  sdata[tid] = i < n ? in[i] : 0.0f;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (tid < s) sdata[tid] += sdata[tid + s];  // consecutive words: one per bank
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 4: first add during the load (a block covers 2 * blockDim elements) --------
__device__ __forceinline__ float load_two(const float* __restrict__ in, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * (2 * blockDim.x) + threadIdx.x;
  float v = i < n ? in[i] : 0.0f;
  if (i + blockDim.x < n) v += in[i + blockDim.x];
  return v;
}

__global__ void reduce4(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  extern __shared__ float sdata[];
  const unsigned tid = threadIdx.x;
  sdata[tid] = load_two(in, n);
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (tid < s) sdata[tid] += sdata[tid + s];
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 5: unroll the last warp -----------------------------------------------------
// Once 64 partial sums are left, only the first warp works. It needs no block-wide
// barrier, only __syncwarp(): since Volta, the threads of a warp may run apart, so
// the old trick of relying on a `volatile` pointer and implicit lock-step is not safe.
__device__ __forceinline__ void warp_reduce_smem(float* sdata, unsigned tid) {
  float v = sdata[tid] + sdata[tid + 32];
#pragma unroll
  for (unsigned offset = 16; offset > 0; offset >>= 1) {
    __syncwarp();  // every lane has read before any lane writes
    sdata[tid] = v;
    __syncwarp();  // every lane has written before any lane reads
    v += sdata[tid + offset];
  }
  if (tid == 0) sdata[0] = v;
}

__global__ void reduce5(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  extern __shared__ float sdata[];
  const unsigned tid = threadIdx.x;
  sdata[tid] = load_two(in, n);
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 32; s >>= 1) {
    if (tid < s) sdata[tid] += sdata[tid + s];
    __syncthreads();
  }
  if (tid < 32) warp_reduce_smem(sdata, tid);
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 6: complete unrolling -------------------------------------------------------
// With the block size known at compile time, the loop disappears: the `if (BLOCK >= ..)`
// tests are resolved by the compiler and only the needed levels remain.
template <unsigned BLOCK>
__device__ __forceinline__ void block_tree_smem(float* sdata, unsigned tid) {
  if (BLOCK >= 1024) { if (tid < 512) sdata[tid] += sdata[tid + 512]; __syncthreads(); }
  if (BLOCK >= 512) { if (tid < 256) sdata[tid] += sdata[tid + 256]; __syncthreads(); }
  if (BLOCK >= 256) { if (tid < 128) sdata[tid] += sdata[tid + 128]; __syncthreads(); }
  if (BLOCK >= 128) { if (tid < 64) sdata[tid] += sdata[tid + 64]; __syncthreads(); }
  if (tid < 32) warp_reduce_smem(sdata, tid);
}

template <unsigned BLOCK>
__global__ void reduce6(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  __shared__ float sdata[BLOCK];
  const unsigned tid = threadIdx.x;
  sdata[tid] = load_two(in, n);
  __syncthreads();
  block_tree_smem<BLOCK>(sdata, tid);
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 7: several elements per thread ----------------------------------------------
// A fixed grid (one wave of resident blocks) walks the whole input; each thread keeps
// its running sum in a register and touches shared memory once.
template <unsigned BLOCK>
__device__ __forceinline__ float grid_stride_sum(const float* __restrict__ in, int64_t n) {
  const int64_t step = static_cast<int64_t>(BLOCK) * 2 * gridDim.x;
  float v = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * (BLOCK * 2) + threadIdx.x; i < n; i += step) {
    v += in[i];
    if (i + BLOCK < n) v += in[i + BLOCK];
  }
  return v;
}

template <unsigned BLOCK>
__global__ void reduce7(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  __shared__ float sdata[BLOCK];
  const unsigned tid = threadIdx.x;
  sdata[tid] = grid_stride_sum<BLOCK>(in, n);
  __syncthreads();
  block_tree_smem<BLOCK>(sdata, tid);
  if (tid == 0) out[blockIdx.x] = sdata[0];
}

// ---- step 8: warp shuffles --------------------------------------------------------------
// __shfl_down_sync reads a register of another lane of the same warp: a warp sums its
// 32 values in 5 instructions with no shared memory and no barrier. One shared word per
// warp and one __syncthreads() are left.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

template <unsigned BLOCK>
__device__ __forceinline__ float block_sum(float v) {
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
  __shared__ float warp_sums[BLOCK / 32];
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_sum(lane < BLOCK / 32 ? warp_sums[lane] : 0.0f);
  return v;  // the block's sum, valid in thread 0
}

template <unsigned BLOCK>
__global__ void reduce8(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  const float v = block_sum<BLOCK>(grid_stride_sum<BLOCK>(in, n));
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// ---- step 9: 16-byte loads, several in flight -------------------------------------------
// Scalar loads for the elements before the first 16-byte boundary and after the last
// whole float4; float4 loads for the rest, kUnroll of them issued before the first add.
template <unsigned BLOCK>
__global__ void reduce9(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  constexpr int kUnroll = 4;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * BLOCK + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(BLOCK) * gridDim.x;
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(in) & 15) / 4;
  const int64_t head = std::min<int64_t>(n, (4 - misalign) & 3);
  const float4* in4 = reinterpret_cast<const float4*>(in + head);
  const int64_t nvec = (n - head) / 4;
  const int64_t tail = head + nvec * 4;
  float v = 0.0f;
  if (tid < head) v += in[tid];
  if (tid < n - tail) v += in[tail + tid];
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  int64_t k = tid;
  for (; k + (kUnroll - 1) * stride < nvec; k += kUnroll * stride) {
    float4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) q[u] = in4[k + u * stride];  // kUnroll loads in flight
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      acc.x += q[u].x; acc.y += q[u].y; acc.z += q[u].z; acc.w += q[u].w;
    }
  }
  for (; k < nvec; k += stride) {
    const float4 q = in4[k];
    acc.x += q.x; acc.y += q.y; acc.z += q.z; acc.w += q.w;
  }
  v += (acc.x + acc.y) + (acc.z + acc.w);
  v = block_sum<BLOCK>(v);
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// ---- host side ---------------------------------------------------------------------------
constexpr int kSteps = 9;

#define LLMNOTE_BLOCK_SWITCH(block, B, ...)                                      \
  switch (block) {                                                              \
    case 64: { constexpr unsigned B = 64; __VA_ARGS__; } break;                 \
    case 128: { constexpr unsigned B = 128; __VA_ARGS__; } break;               \
    case 256: { constexpr unsigned B = 256; __VA_ARGS__; } break;               \
    case 512: { constexpr unsigned B = 512; __VA_ARGS__; } break;               \
    case 1024: { constexpr unsigned B = 1024; __VA_ARGS__; } break;             \
    default: TORCH_CHECK(false, "block must be 64, 128, 256, 512 or 1024, got ", block); \
  }

using Kernel = void (*)(const float*, float*, int64_t);

Kernel kernel_for(int step, int block) {
  switch (step) {
    case 1: return reduce1;
    case 2: return reduce2;
    case 3: return reduce3;
    case 4: return reduce4;
    case 5: return reduce5;
  }
  Kernel k = nullptr;
  LLMNOTE_BLOCK_SWITCH(block, B, {
    if (step == 6) k = reduce6<B>;
    if (step == 7) k = reduce7<B>;
    if (step == 8) k = reduce8<B>;
    if (step == 9) k = reduce9<B>;
  });
  TORCH_CHECK(k != nullptr, "reduce: step must be 1..", kSteps, ", got ", step);
  return k;
}

size_t dynamic_smem(int step, int block) { return step <= 5 ? block * sizeof(float) : 0; }

// Blocks of this kernel that fit on the whole GPU at once (one full wave).
// Asked once per (device, step, block), then remembered: it is on every call's path.
int64_t resident_blocks(int step, int block) {
  static std::map<std::vector<int>, int64_t> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const std::vector<int> key = {dev, step, block};
  auto hit = cache.find(key);
  if (hit != cache.end()) return hit->second;
  int sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel_for(step, block), block, dynamic_smem(step, block)));
  return cache[key] = static_cast<int64_t>(sms) * per_sm;
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid of each launch for `n` inputs (the Python function llmnote.cuda.launch_plan
// mirrors this; a GPU test checks they agree).
std::vector<int64_t> plan(int64_t n, int step, int block, int64_t resident) {
  std::vector<int64_t> grids;
  int64_t count = n;
  while (count > 1 || (grids.empty() && count == 1)) {
    int64_t g;
    if (step <= 3) g = cdiv(count, block);
    else if (step <= 6) g = cdiv(count, 2 * block);
    else if (!grids.empty()) g = 1;  // second pass: one block walks the partial sums
    else g = std::min(cdiv(count, (step == 9 ? 4 : 2) * block), resident);
    grids.push_back(g);
    count = g;
  }
  return grids;
}

void check_step_block(int64_t step, int64_t block) {
  TORCH_CHECK(step >= 1 && step <= kSteps, "reduce: step must be 1..", kSteps, ", got ", step);
  TORCH_CHECK(block == 64 || block == 128 || block == 256 || block == 512 || block == 1024,
              "reduce: block must be 64, 128, 256, 512 or 1024, got ", block);
}

}  // namespace llmnote_red

// Sum of a contiguous fp32 CUDA tensor with ladder step `step`, `block` threads per block.
torch::Tensor reduce_sum(torch::Tensor x, int64_t step, int64_t block) {
  using namespace llmnote_red;
  check_step_block(step, block);
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "reduce_sum: x must be a contiguous float32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  if (n == 0) return torch::zeros({}, x.options());
  const int64_t resident = step >= 7 ? resident_blocks(step, block) : 0;
  const Kernel kernel = kernel_for(step, block);
  const size_t smem = dynamic_smem(step, block);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  torch::Tensor in = x;
  int64_t count = n;
  for (int64_t grid : plan(n, step, block, resident)) {
    TORCH_CHECK(grid < (int64_t{1} << 31), "reduce_sum: grid too large");
    torch::Tensor out = torch::empty({grid}, x.options());
    kernel<<<grid, block, smem, stream>>>(in.data_ptr<float>(), out.data_ptr<float>(), count);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    in = out;
    count = grid;
  }
  return in.reshape({});
}

// The grids reduce_sum would launch for n elements on the current GPU.
std::vector<int64_t> reduce_plan(int64_t n, int64_t step, int64_t block) {
  using namespace llmnote_red;
  check_step_block(step, block);
  return plan(n, step, block, step >= 7 ? resident_blocks(step, block) : 0);
}

// Blocks of step `step` resident on the whole GPU at once (occupancy x SM count).
int64_t reduce_resident_blocks(int64_t step, int64_t block) {
  llmnote_red::check_step_block(step, block);
  return llmnote_red::resident_blocks(step, block);
}

// What the compiler gave step `step`'s kernel (registers per thread, static shared
// memory, local memory per thread) and how many of its blocks one SM holds at once.
std::map<std::string, int64_t> reduce_kernel_attributes(int64_t step, int64_t block) {
  using namespace llmnote_red;
  check_step_block(step, block);
  cudaFuncAttributes fa;
  const Kernel kernel = kernel_for(step, block);
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block,
                                                               dynamic_smem(step, block)));
  return {{"registers_per_thread", fa.numRegs},
          {"static_shared_bytes", static_cast<int64_t>(fa.sharedSizeBytes)},
          {"dynamic_shared_bytes", static_cast<int64_t>(dynamic_smem(step, block))},
          {"local_bytes_per_thread", static_cast<int64_t>(fa.localSizeBytes)},
          {"blocks_per_multiprocessor", per_sm}};
}

// A few attributes of the current GPU, read with cudaDeviceGetAttribute.
std::map<std::string, int64_t> device_attributes() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const std::vector<std::pair<std::string, cudaDeviceAttr>> attrs = {
      {"multiprocessors", cudaDevAttrMultiProcessorCount},
      {"warp_size", cudaDevAttrWarpSize},
      {"max_threads_per_multiprocessor", cudaDevAttrMaxThreadsPerMultiProcessor},
      {"max_blocks_per_multiprocessor", cudaDevAttrMaxBlocksPerMultiprocessor},
      {"registers_per_multiprocessor", cudaDevAttrMaxRegistersPerMultiprocessor},
      {"shared_memory_per_multiprocessor", cudaDevAttrMaxSharedMemoryPerMultiprocessor},
      {"shared_memory_per_block_optin", cudaDevAttrMaxSharedMemoryPerBlockOptin},
      {"l2_cache_bytes", cudaDevAttrL2CacheSize},
      {"sm_clock_khz", cudaDevAttrClockRate},
      {"memory_clock_khz", cudaDevAttrMemoryClockRate},
      {"memory_bus_width_bits", cudaDevAttrGlobalMemoryBusWidth},
  };
  std::map<std::string, int64_t> out;
  for (const auto& [name, attr] : attrs) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, dev));
    out[name] = value;
  }
  return out;
}
