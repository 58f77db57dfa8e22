// GroupNorm (+ channel bias, residual, SiLU) for channels_last (NHWC) and contiguous NCHW tensors in ONE read and
// one write: thread-block clusters hold a whole unit in registers and reduce its statistics through distributed
// shared memory (Hopper, sm_90+). NHWC: a unit is a (batch, channel slice), described first below; NCHW: a
// (batch, group), whose values are contiguous (gn_cluster_nchw_kernel, further down).
//
//     pre = x (+ residual) (+ channel_bias[b, c])         added in fp32, rounded once to x's dtype
//     y   = (pre - mean[b, g]) * rstd[b, g] * weight[c] + bias[c],  then SiLU when asked
//
// Work split. A "unit" is one batch item and CS channels (CS / Cg whole groups, a multiple of the 16-byte vector);
// a cluster of K CTAs owns a unit and splits its H*W pixels into K runs of R*J pixels. Thread t of a CTA owns
// the 16-byte vector v = t % V (V = CS / VEC) of pixel rows r, r + R, ..., r + (J-1) R (r = t / V), so a
// CTA's loads are whole CS-channel row segments. Each thread keeps its J vectors in registers from the load to
// the store: the input is read once from memory.
//
// Statistics in one round: each thread sums d = pre - shift and d^2 per channel, where shift is the channel's
// value at pixel 0 of the batch item (every CTA of the cluster loads the same one, so the shifted sums add up
// across CTAs; the shift keeps the sum of squares from cancelling when |mean| >> std, the "shifted data"
// method). Per-channel sums of the CTA (registers -> shared memory -> two-level tree, unrolled) -> one cluster
// barrier -> each CTA adds the K CTAs' per-channel sums through distributed shared memory -> per-channel mean
// and M2 -> group mean and M2 by Chan's combination. The second cluster barrier is split (arrive after the
// remote reads, wait after the stores): no CTA exits while another still reads its shared memory, and the
// barrier's latency hides behind the stores.
//
// Clusters are co-scheduled by the hardware, so the barriers cannot deadlock, whatever else runs on the GPU
// (a grid-wide barrier over global-memory counters can, when not every CTA is resident).
//
// Method: Wu & He 2018 (GroupNorm); Chan, Golub & LeVeque 1979 (combining per-channel variances); thread-block
// clusters and distributed shared memory as in the CUDA Programming Guide (Hopper); one-read GroupNorm as in TensorRT's and Apex's NHWC GroupNorm kernels, which
// synchronize through global memory instead.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace {

// The tensors of both kernels (an aggregate base: Params{{x, ...}, HW, ...}).
struct Tensors {
  const void* x;
  const void* res;   // like x, or null
  const void* cb;    // channel bias (B or 1, C) in x's dtype, or null
  const void* w;     // (C,) in x's dtype, or null
  const void* bias;  // (C,) in x's dtype, or null
  void* y;
  void* pre;         // written when non-null
};

struct Params : Tensors {
  int HW, C, Cg, CS, nslices, R, nt;  // nt = (CS / VEC) * R working threads (the block is rounded up to warps)
  int64_t cb_bstride;  // elements between the channel bias's batch rows (0: one row for every batch item)
  float eps;
  int silu;
};

// Shared memory: float2 red[R][CS + 1] | float2 part[Q][CS] | float2 ch[CS] | float shift[CS] | w[CS] | b[CS] |
// mean[ngs] | rstd[ngs]   (Q = nt / CS partial rows, nt the working threads)
__host__ __device__ inline int num_q(int nt, int cs) { return nt >= cs ? nt / cs : 1; }
__host__ __device__ inline int smem_floats(int R, int CS, int Cg, int nt) {
  return 2 * (R * (CS + 1) + num_q(nt, CS) * CS + CS) + 3 * CS + 2 * (CS / Cg);
}
__host__ __device__ inline int block_threads(int nt) { return (nt + 31) / 32 * 32; }

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // device helpers: sm_90+ only

template <typename T> struct Vec;

// 16-bit types: eight values in one 16-byte vector, converted in pairs
__device__ inline float2 to_float2(__half2 h) { return __half22float2(h); }
__device__ inline float2 to_float2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ inline void from_floats(float a, float b, __half2* h) { *h = __floats2half2_rn(a, b); }
__device__ inline void from_floats(float a, float b, __nv_bfloat162* h) { *h = __floats2bfloat162_rn(a, b); }
__device__ inline float to_float(__half h) { return __half2float(h); }
__device__ inline float to_float(__nv_bfloat16 h) { return __bfloat162float(h); }

template <typename T, typename T2> struct Vec16 {
  static constexpr int N = 8;
  __device__ static void load(const uint4& u, float* f) {
    const T2* h = reinterpret_cast<const T2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 p = to_float2(h[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ static uint4 store(const float* f) {
    uint4 u;
    T2* h = reinterpret_cast<T2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) from_floats(f[2 * i], f[2 * i + 1], &h[i]);
    return u;
  }
  __device__ static float scalar(const void* p, int64_t i) { return to_float(static_cast<const T*>(p)[i]); }
};

template <> struct Vec<__half> : Vec16<__half, __half2> {};
template <> struct Vec<__nv_bfloat16> : Vec16<__nv_bfloat16, __nv_bfloat162> {};

template <> struct Vec<float> {
  static constexpr int N = 4;
  __device__ static void load(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
  __device__ static uint4 store(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ static float scalar(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
};

// Not the .aligned forms: threads reach these after loops of different trip counts.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }

__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));  // read once: evict-first
}

__device__ __forceinline__ float2 add2(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

// The CTA's per-channel (sum d, sum d^2) into ch[0..CS) (acc: this thread's VEC channels of pixel row r). ch is
// complete only after the caller's next barrier (the cluster barrier that follows).
template <int VEC>
__device__ __forceinline__ void cta_channel_sums(const float2* acc, float2* red, float2* part, float2* ch, int CS, int R,
                                                 int cl, int r, int nt_work, bool working) {
  const int nt = blockDim.x, t = threadIdx.x, Q = num_q(nt_work, CS);
  if (working) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) red[r * (CS + 1) + cl + i] = acc[i];
  }
  __syncthreads();
  for (int idx = t; idx < Q * CS; idx += nt) {
    const int c = idx % CS, q = idx / CS;
    float2 s = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int rr = q; rr < R; rr += Q) s = add2(s, red[rr * (CS + 1) + c]);
    part[q * CS + c] = s;
  }
  __syncthreads();
  for (int c = t; c < CS; c += nt) {
    float2 s = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int q = 0; q < Q; ++q) s = add2(s, part[q * CS + c]);
    ch[c] = s;
  }
}

#endif  // device helpers

// Threads per CTA the NHWC kernel is compiled for: up to 5 vectors per thread fit 64 registers (1024 threads);
// more need up to 93 (nvcc 13), so 320, with two CTAs per SM (a cluster of 8 such CTAs then fits 2 per GPC's 16
// SMs, not 1: SD1.5's (2, 320, 64, 64) needs 16 clusters at once, and the H200 holds only 15 at one CTA per SM).
__host__ __device__ constexpr int nhwc_max_threads(int J) { return J <= 5 ? 1024 : 320; }

template <typename T, int J>
__global__ void __launch_bounds__(nhwc_max_threads(J), J <= 5 ? 1 : 2) gn_cluster_nhwc_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; the Python launcher never launches this on older GPUs
#else
  using V_ = Vec<T>;
  constexpr int VEC = V_::N;
  extern __shared__ float smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int k = static_cast<int>(cluster.block_rank());
  const int unit = blockIdx.y;
  const int b = unit / p.nslices, s = unit - b * p.nslices;
  const int CS = p.CS, R = p.R, ngs = CS / p.Cg;
  const int nv = CS / VEC;
  const bool working = threadIdx.x < p.nt;  // the rest of the last warp only helps with the reductions
  const int v = threadIdx.x % nv, r = working ? threadIdx.x / nv : R;
  const int c0 = s * CS + v * VEC;  // this thread's first channel
  const int64_t base = static_cast<int64_t>(b) * p.HW * p.C + c0;
  const int pix0 = k * R * J + r;  // cluster rank k owns pixels [k R J, (k + 1) R J)

  float2* red = reinterpret_cast<float2*>(smem);
  float2* part = red + R * (CS + 1);
  float2* ch = part + num_q(p.nt, CS) * CS;
  float* shift_s = reinterpret_cast<float*>(ch + CS);
  float* w_s = shift_s + CS;
  float* b_s = w_s + CS;
  float* mean_s = b_s + CS;
  float* rstd_s = mean_s + ngs;
  const int cl = v * VEC;  // this thread's first channel inside the slice
  const bool adds = p.cb != nullptr || p.res != nullptr;

  // 1. Load the J vectors (all loads issued before any use) and pixel 0's (the shift).
  uint4 xr[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int pix = pix0 + j * R;
    xr[j] = working && pix < p.HW ? ldg_stream(static_cast<const T*>(p.x) + base + static_cast<int64_t>(pix) * p.C)
                       : make_uint4(0, 0, 0, 0);
  }
  if (r == 0) {  // weight and bias loaded now (into shared memory), used after the barriers
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      w_s[cl + i] = p.w != nullptr ? V_::scalar(p.w, c0 + i) : 1.f;
      b_s[cl + i] = p.bias != nullptr ? V_::scalar(p.bias, c0 + i) : 0.f;
    }
  }
  float shift[VEC], cbv[VEC];
  V_::load(working ? *reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + base) : make_uint4(0, 0, 0, 0), shift);
#pragma unroll
  for (int i = 0; i < VEC; ++i)
    cbv[i] = p.cb != nullptr && working ? V_::scalar(p.cb, static_cast<int64_t>(b) * p.cb_bstride + c0 + i) : 0.f;
  if (adds && working) {  // pre = x + residual + channel bias in fp32, rounded once to x's dtype
    float rv[VEC];
    if (p.res != nullptr) {
      V_::load(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.res) + base), rv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) shift[i] += rv[i];
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) shift[i] += cbv[i];
    V_::load(V_::store(shift), shift);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int pix = pix0 + j * R;
      if (!working || pix >= p.HW) continue;
      const int64_t off = base + static_cast<int64_t>(pix) * p.C;
      float f[VEC];
      V_::load(xr[j], f);
      if (p.res != nullptr) {
        V_::load(ldg_stream(static_cast<const T*>(p.res) + off), rv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) f[i] += rv[i];
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) f[i] += cbv[i];
      xr[j] = V_::store(f);
      if (p.pre != nullptr) *reinterpret_cast<uint4*>(static_cast<T*>(p.pre) + off) = xr[j];
    }
  }
  if (r == 0) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) shift_s[cl + i] = shift[i];
  }

  // 2. Shifted per-channel sums of the CTA, then of the cluster.
  float2 acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = make_float2(0.f, 0.f);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if (!working || pix0 + j * R >= p.HW) continue;
    float f[VEC];
    V_::load(xr[j], f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float d = f[i] - shift[i];
      acc[i].x += d;
      acc[i].y = fmaf(d, d, acc[i].y);
    }
  }
  cta_channel_sums<VEC>(acc, red, part, ch, CS, R, cl, r, p.nt, working);
  cluster.sync();  // every CTA's ch[] is complete
  const int K = static_cast<int>(cluster.num_blocks());
  float2* tot = part;  // this CTA's own part[] is free again
  for (int c = threadIdx.x; c < CS; c += blockDim.x) {
    float2 s2 = make_float2(0.f, 0.f);
#pragma unroll 4
    for (int q = 0; q < K; ++q) s2 = add2(s2, *cluster.map_shared_rank(ch + c, q));
    tot[c] = s2;
  }
  cluster_arrive();  // done reading the other CTAs' shared memory
  __syncthreads();

  // 3. Group statistics: per channel (a thread each) mu_c = shift_c + S1_c / HW and M2_c = S2_c - S1_c^2 / HW;
  //    per group (a warp each) mean = avg mu_c and M2 = sum M2_c + HW * sum (mu_c - mean)^2 (Chan), both taken
  //    relative to the shift of the group's first channel.
  const float hw = static_cast<float>(p.HW), inv_hw = 1.f / hw;
  for (int c = threadIdx.x; c < CS; c += blockDim.x) {  // mu_c relative to the group's first shift (no
    const float2 t2 = tot[c];                            // large sums of large means)
    const float s_g = shift_s[c - c % p.Cg];
    tot[c] = make_float2((shift_s[c] - s_g) + t2.x * inv_hw, fmaxf(t2.y - t2.x * t2.x * inv_hw, 0.f));
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
  const float inv_cg = 1.f / static_cast<float>(p.Cg);
  for (int g = threadIdx.x >> 5; g < ngs; g += nwarps) {
    float mean = 0.f;
    for (int i = lane; i < p.Cg; i += 32) mean += tot[g * p.Cg + i].x;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mean += __shfl_xor_sync(0xffffffffu, mean, o);
    mean *= inv_cg;
    float m2 = 0.f;
    for (int i = lane; i < p.Cg; i += 32) {
      const float2 mc = tot[g * p.Cg + i];
      const float dm = mc.x - mean;
      m2 += fmaf(hw * dm, dm, mc.y);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m2 += __shfl_xor_sync(0xffffffffu, m2, o);
    if (lane == 0) {
      mean_s[g] = shift_s[g * p.Cg] + mean;
      rstd_s[g] = rsqrtf(m2 * inv_hw * inv_cg + p.eps);
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < CS; c += blockDim.x) {  // per channel (mean, rstd * weight): one division each here
    const int g = c / p.Cg;                               // instead of VEC per thread below
    tot[c] = make_float2(mean_s[g], rstd_s[g] * w_s[c]);
  }
  __syncthreads();

  // 4. Normalize from the registers and store.
  float mean_c[VEC], a_c[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float2 ma = tot[cl + i];
    mean_c[i] = ma.x;
    a_c[i] = ma.y;
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int pix = pix0 + j * R;
    if (!working || pix >= p.HW) continue;
    float f[VEC];
    V_::load(xr[j], f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float yv = fmaf(f[i] - mean_c[i], a_c[i], b_s[cl + i]);
      if (p.silu) yv = __fdividef(yv, 1.f + __expf(fminf(-yv, 80.f)));  // e^80 < 2^126: the fast divide holds
      f[i] = yv;
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + base + static_cast<int64_t>(pix) * p.C) = V_::store(f);
  }
  cluster_wait();  // keep this CTA's shared memory alive until every CTA of the cluster has read it
#endif
}

// NCHW: a unit is one (batch item, group), whose Cg * HW values are contiguous; a cluster of K CTAs owns a unit,
// CTA k the vectors [k nt J, (k + 1) nt J) of it, thread t the vectors k nt J + t + j nt (j < J: coalesced). HW is a
// multiple of the vector, so a vector lies in one channel. The statistics are the unit's shifted sums (shift: its
// first value, which every CTA loads), one (sum d, sum d^2) pair per CTA exchanged through distributed shared memory.
struct NchwParams : Tensors {
  int HW, C, Cg, G, nt;  // nt working threads per CTA (the block is rounded up to warps)
  int64_t cb_bstride;
  float eps;
  int silu;
};

template <typename T, int J>
__global__ void __launch_bounds__(1024) gn_cluster_nchw_kernel(const NchwParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
#else
  using V_ = Vec<T>;
  constexpr int VEC = V_::N;
  __shared__ float2 warp_sums[32];
  __shared__ float2 cta_sum;
  __shared__ float stats[2];
  cg::cluster_group cluster = cg::this_cluster();
  const int k = static_cast<int>(cluster.block_rank()), K = static_cast<int>(cluster.num_blocks());
  const int b = blockIdx.y / p.G, g = blockIdx.y - b * p.G;
  const int c_first = g * p.Cg;
  const int nvec = p.Cg * p.HW / VEC;  // vectors in the unit
  const int64_t base = (static_cast<int64_t>(b) * p.C + c_first) * p.HW;
  const int v0 = k * p.nt * J + threadIdx.x;
  const bool working = threadIdx.x < p.nt;
  const T* x = static_cast<const T*>(p.x) + base;

  // 1. Load the J vectors (all issued before any use) and the unit's first value (the shift).
  uint4 xr[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int v = v0 + j * p.nt;
    xr[j] = working && v < nvec ? ldg_stream(x + static_cast<int64_t>(v) * VEC) : make_uint4(0, 0, 0, 0);
  }
  const int64_t cb_row = static_cast<int64_t>(b) * p.cb_bstride;
  float shift = V_::scalar(x, 0);
  if (p.res != nullptr || p.cb != nullptr) {  // pre = x + residual + channel bias in fp32, rounded once to x's dtype
    const T* res = static_cast<const T*>(p.res) + base;
    if (p.res != nullptr) shift += V_::scalar(res, 0);
    if (p.cb != nullptr) shift += V_::scalar(p.cb, cb_row + c_first);
    float sv[VEC] = {shift};
    float rounded[VEC];
    V_::load(V_::store(sv), rounded);
    shift = rounded[0];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int v = v0 + j * p.nt;
      if (!working || v >= nvec) continue;
      const int64_t off = static_cast<int64_t>(v) * VEC;
      const float cbv = p.cb != nullptr ? V_::scalar(p.cb, cb_row + c_first + v * VEC / p.HW) : 0.f;
      float f[VEC], rv[VEC];
      V_::load(xr[j], f);
      if (p.res != nullptr) {
        V_::load(ldg_stream(res + off), rv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) f[i] += rv[i];
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) f[i] += cbv;
      xr[j] = V_::store(f);
      if (p.pre != nullptr) *reinterpret_cast<uint4*>(static_cast<T*>(p.pre) + base + off) = xr[j];
    }
  }

  // 2. Shifted sums: thread -> warp (shuffles) -> CTA (shared memory) -> cluster (distributed shared memory).
  float2 acc = make_float2(0.f, 0.f);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    float f[VEC];
    V_::load(xr[j], f);
    if (!working || v0 + j * p.nt >= nvec) continue;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float d = f[i] - shift;
      acc.x += d;
      acc.y = fmaf(d, d, acc.y);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc.x += __shfl_xor_sync(0xffffffffu, acc.x, o);
    acc.y += __shfl_xor_sync(0xffffffffu, acc.y, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    float2 s2 = lane < nwarps ? warp_sums[lane] : make_float2(0.f, 0.f);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s2.x += __shfl_xor_sync(0xffffffffu, s2.x, o);
      s2.y += __shfl_xor_sync(0xffffffffu, s2.y, o);
    }
    if (lane == 0) cta_sum = s2;
  }
  cluster.sync();  // every CTA's cta_sum is written
  if (warp == 0) {
    float2 s2 = lane < K ? *cluster.map_shared_rank(&cta_sum, lane) : make_float2(0.f, 0.f);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {  // K <= 16
      s2.x += __shfl_xor_sync(0xffffffffu, s2.x, o);
      s2.y += __shfl_xor_sync(0xffffffffu, s2.y, o);
    }
    if (lane == 0) {
      const float n = static_cast<float>(p.Cg) * static_cast<float>(p.HW);
      const float m1 = s2.x / n;
      stats[0] = shift + m1;
      stats[1] = rsqrtf(fmaxf(s2.y / n - m1 * m1, 0.f) + p.eps);
    }
  }
  cluster_arrive();  // done reading the other CTAs' shared memory
  __syncthreads();

  // 3. Normalize from the registers and store.
  const float mean = stats[0], rstd = stats[1];
  T* y = static_cast<T*>(p.y) + base;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int v = v0 + j * p.nt;
    if (!working || v >= nvec) continue;
    const int c = c_first + v * VEC / p.HW;
    const float a = rstd * (p.w != nullptr ? V_::scalar(p.w, c) : 1.f);
    const float bb = p.bias != nullptr ? V_::scalar(p.bias, c) : 0.f;
    float f[VEC];
    V_::load(xr[j], f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float yv = fmaf(f[i] - mean, a, bb);
      if (p.silu) yv = __fdividef(yv, 1.f + __expf(fminf(-yv, 80.f)));
      f[i] = yv;
    }
    *reinterpret_cast<uint4*>(y + static_cast<int64_t>(v) * VEC) = V_::store(f);
  }
  cluster_wait();  // keep this CTA's shared memory alive until every CTA of the cluster has read it
#endif
}

// A cluster launch of `kernel`: grid (K, units), clusters of K CTAs along x, `threads` per CTA.
template <typename Kern>
cudaError_t cluster_config(Kern kernel, int K, int units, int threads, size_t smem, cudaStream_t stream,
                           cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attr) {
  if (K > 8) {  // clusters of more than 8 CTAs are "non-portable": opt in
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  *cfg = cudaLaunchConfig_t{};
  cfg->gridDim = dim3(K, units, 1);
  cfg->blockDim = dim3(threads, 1, 1);
  cfg->dynamicSmemBytes = smem;
  cfg->stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = K;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
  return cudaSuccess;
}

// Launch `kernel` (units > 0), or count how many of its clusters can be resident at once (units == 0).
template <typename Kern, typename P>
cudaError_t launch_or_count(Kern kernel, const P& p, int K, int units, int threads, size_t smem, cudaStream_t stream,
                            int* n) {
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[1];
  cudaError_t e = cluster_config(kernel, K, units > 0 ? units : 1, threads, smem, stream, &cfg, attr);
  if (e != cudaSuccess) return e;
  return units > 0 ? cudaLaunchKernelEx(&cfg, kernel, p) : cudaOccupancyMaxActiveClusters(n, kernel, &cfg);
}

template <typename T, int J>
cudaError_t nhwc_j(const Params& p, int B, int K, int nt, cudaStream_t stream, int* n) {
  const size_t smem = sizeof(float) * smem_floats(p.R, p.CS, p.Cg, nt);  // <= 48 KB (checked by entry)
  return launch_or_count(gn_cluster_nhwc_kernel<T, J>, p, K, B * p.nslices, block_threads(nt), smem, stream, n);
}

template <typename T, int J>
cudaError_t nchw_j(const NchwParams& p, int units, int K, cudaStream_t stream, int* n) {
  return launch_or_count(gn_cluster_nchw_kernel<T, J>, p, K, units, block_threads(p.nt), 0, stream, n);
}

#define SDFAST_GN_SWITCH_J(CALL)                 \
  switch (J) {                                  \
    case 1: return CALL(1);                     \
    case 2: return CALL(2);                     \
    case 3: return CALL(3);                     \
    case 4: return CALL(4);                     \
    case 5: return CALL(5);                     \
    case 6: return CALL(6);                     \
    case 7: return CALL(7);                     \
    case 8: return CALL(8);                     \
    default: return cudaErrorInvalidValue;      \
  }

template <typename T>
cudaError_t nhwc_t(const Params& p, int B, int K, int J, int nt, cudaStream_t stream, int* n) {
#define SDFAST_CALL(j) nhwc_j<T, j>(p, B, K, nt, stream, n)
  SDFAST_GN_SWITCH_J(SDFAST_CALL)
#undef SDFAST_CALL
}

template <typename T>
cudaError_t nchw_t(const NchwParams& p, int units, int K, int J, cudaStream_t stream, int* n) {
#define SDFAST_CALL(j) nchw_j<T, j>(p, units, K, stream, n)
  SDFAST_GN_SWITCH_J(SDFAST_CALL)
#undef SDFAST_CALL
}

// Error codes (negative: our checks; positive: a cudaError_t).
#define SDFAST_GN_BAD_SPLIT (-2)
#define SDFAST_GN_BAD_ALIGN (-3)

template <typename T>
int entry(const void* x, const void* res, const void* cb, const void* w, const void* bias, void* y, void* pre, int B,
          int C, int HW, int G, int CS, int K, int R, int J, long long cb_bstride, float eps, int silu, void* stream) {
  constexpr int vec = 16 / static_cast<int>(sizeof(T));
  if (G <= 0 || C % G != 0) return SDFAST_GN_BAD_SPLIT;
  const int Cg = C / G;
  const int nt = CS / vec * R;
  if (CS <= 0 || C % CS != 0 || CS % Cg != 0 || CS % vec != 0 || K < 1 || K > 16 || J < 1 || J > 8 || R < 1 ||
      nt > nhwc_max_threads(J) || static_cast<long long>(K) * R * J < HW)
    return SDFAST_GN_BAD_SPLIT;
  const void* ptrs[] = {x, res, y, pre};
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return SDFAST_GN_BAD_ALIGN;
  if (sizeof(float) * smem_floats(R, CS, Cg, nt) > 48 * 1024) return SDFAST_GN_BAD_SPLIT;
  Params p{{x, res, cb, w, bias, y, pre}, HW, C, Cg, CS, C / CS, R, nt, cb_bstride, eps, silu};
  const cudaError_t e = nhwc_t<T>(p, B, K, J, nt, static_cast<cudaStream_t>(stream), nullptr);
  if (e != cudaSuccess) cudaGetLastError();  // clear it: the caller raises; PyTorch's next check must not see it
  return static_cast<int>(e);
}

template <typename T>
int max_active_entry(int C, int G, int CS, int K, int R, int J) {
  constexpr int vec = 16 / static_cast<int>(sizeof(T));
  if (G <= 0 || C % G != 0 || CS <= 0 || J < 1 || J > 8 || K < 1 || K > 16) return SDFAST_GN_BAD_SPLIT;
  Params p{};
  p.C = C;
  p.Cg = C / G;
  p.CS = CS;
  p.R = R;
  p.nslices = C / CS;
  p.nt = CS / vec * R;
  if (p.nt > nhwc_max_threads(J) || sizeof(float) * smem_floats(R, CS, p.Cg, p.nt) > 48 * 1024) return SDFAST_GN_BAD_SPLIT;
  int n = 0;
  const cudaError_t e = nhwc_t<T>(p, 0, K, J, p.nt, nullptr, &n);
  if (e != cudaSuccess) cudaGetLastError();  // a configuration that cannot launch: clear the (non-sticky) error
  return e == cudaSuccess ? n : -static_cast<int>(e);
}

template <typename T>
int nchw_entry(const void* x, const void* res, const void* cb, const void* w, const void* bias, void* y, void* pre,
               int B, int C, int HW, int G, int K, int nt, int J, long long cb_bstride, float eps, int silu,
               void* stream) {
  constexpr int vec = 16 / static_cast<int>(sizeof(T));
  if (G <= 0 || C % G != 0 || HW % vec != 0 || K < 1 || K > 16 || J < 1 || J > 8 || nt < 1 || nt > 1024 ||
      static_cast<long long>(K) * nt * J * vec < static_cast<long long>(C / G) * HW)
    return SDFAST_GN_BAD_SPLIT;
  const void* ptrs[] = {x, res, y, pre};
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return SDFAST_GN_BAD_ALIGN;
  NchwParams p{{x, res, cb, w, bias, y, pre}, HW, C, C / G, G, nt, cb_bstride, eps, silu};
  const cudaError_t e = nchw_t<T>(p, B * G, K, J, static_cast<cudaStream_t>(stream), nullptr);
  if (e != cudaSuccess) cudaGetLastError();  // clear it: the caller raises; PyTorch's next check must not see it
  return static_cast<int>(e);
}

template <typename T>
int nchw_max_active_entry(int K, int nt, int J) {
  if (J < 1 || J > 8 || K < 1 || K > 16 || nt < 1 || nt > 1024) return SDFAST_GN_BAD_SPLIT;
  NchwParams p{};
  p.nt = nt;
  int n = 0;
  const cudaError_t e = nchw_t<T>(p, 0, K, J, nullptr, &n);
  if (e != cudaSuccess) cudaGetLastError();
  return e == cudaSuccess ? n : -static_cast<int>(e);
}

}  // namespace

// Entry points, one pair per dtype: sdfast_gn_cluster_nhwc_<f16|bf16|f32> launches, and
// sdfast_gn_cluster_max_active_<...> returns how many clusters of that configuration can be resident at once
// (cudaOccupancyMaxActiveClusters: 0 when K cannot launch, negative on error).
// x, res, y, pre: (B, C, H, W) channels_last, contiguous in that layout, 16-byte aligned; res / cb / w / bias / pre
// may be null. CS channels per slice (C % CS == 0, CS % Cg == 0, CS a multiple of the 16-byte vector), a cluster
// of K CTAs of nt = (CS / VEC) * R threads per (batch item, slice), each CTA R * J pixels, K * R * J >= HW,
// nt <= nhwc_max_threads(J) (1024 up to J = 5, else 320), 1 <= J <= 8, K <= 16. Built with -DSDFAST_GN_DTYPE=0/1/2, an object holds one dtype's kernels (the
// library is three objects compiled in parallel); without it, all three.
#define SDFAST_GN_ENTRIES(SUFFIX, T)                                                                               \
  extern "C" int sdfast_gn_cluster_nhwc_##SUFFIX(const void* x, const void* res, const void* cb, const void* w,     \
                                                 const void* bias, void* y, void* pre, int B, int C, int HW, int G, \
                                                 int CS, int K, int R, int J, long long cb_bstride, float eps,     \
                                                 int silu, void* stream) {                                          \
    return entry<T>(x, res, cb, w, bias, y, pre, B, C, HW, G, CS, K, R, J, cb_bstride, eps, silu, stream);          \
  }                                                                                                                  \
  extern "C" int sdfast_gn_cluster_max_active_##SUFFIX(int C, int G, int CS, int K, int R, int J) {                 \
    return max_active_entry<T>(C, G, CS, K, R, J);                                                                   \
  }                                                                                                                  \
  extern "C" int sdfast_gn_cluster_nchw_##SUFFIX(const void* x, const void* res, const void* cb, const void* w,     \
                                                 const void* bias, void* y, void* pre, int B, int C, int HW, int G, \
                                                 int K, int nt, int J, long long cb_bstride, float eps, int silu,   \
                                                 void* stream) {                                                    \
    return nchw_entry<T>(x, res, cb, w, bias, y, pre, B, C, HW, G, K, nt, J, cb_bstride, eps, silu, stream);         \
  }                                                                                                                  \
  extern "C" int sdfast_gn_cluster_nchw_max_active_##SUFFIX(int K, int nt, int J) {                                 \
    return nchw_max_active_entry<T>(K, nt, J);                                                                       \
  }

#if !defined(SDFAST_GN_DTYPE) || SDFAST_GN_DTYPE == 0
SDFAST_GN_ENTRIES(f16, __half)
#endif
#if !defined(SDFAST_GN_DTYPE) || SDFAST_GN_DTYPE == 1
SDFAST_GN_ENTRIES(bf16, __nv_bfloat16)
#endif
#if !defined(SDFAST_GN_DTYPE) || SDFAST_GN_DTYPE == 2
SDFAST_GN_ENTRIES(f32, float)
#endif
