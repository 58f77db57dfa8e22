// sdfast: W4A16 GEMM staged through shared memory with explicit cp.async PTX.
//
//   C[M, N] = A[M, K] @ dequant(QW)[N, K]^T (+ bias[N])        (the weight as nn.Linear stores it)
//
// * Tiles BM x BN x BK = 128 x 128 x 32, 256 threads (8 warps as 2 along M x 4 along N, each warp
//   computes 64 x 32 with 4 x 4 mma.sync.aligned.m16n8k16 fp16 -> fp32 tensor-core MMAs per k16).
// * A 3-stage ring of shared-memory buffers is filled with `cp.async.cg.shared.global` 16-byte
//   copies (L2 only, bypassing L1); each K tile is one `cp.async.commit_group`, and
//   `cp.async.wait_group STAGES-2` before a tile is used keeps STAGES-1 tiles in flight while the
//   tensor cores work on the current one. Out-of-range 16-byte chunks use the src-size operand 0,
//   so cp.async zero-fills them (M, N tails; K must be a multiple of 8).
// * Shared rows are padded to BK + 8 halves (80 bytes): the 8 row addresses of every ldmatrix
//   phase fall in distinct banks, and rows stay 16-byte aligned for cp.async / ldmatrix.
// * The weight arrives as packed int4 (int32 (N, K/8), nibble k%8 of word k/8 holds element k, lowest
//   nibble first), with per-group fp16 scales and uint8 zeros (N, ceil(K/group_size)). The packed
//   tile (BN x 16 bytes) rides the same cp.async ring; once it has landed in shared memory the block
//   dequantizes it, w = (q - zero) * scale, into one fp16 tile that the MMAs read.
//
// Pure CUDA (no torch headers): the launchers are `extern "C"`, called from gemm_binding.cpp (a
// torch extension built by kernels/csrc/build.py) or through ctypes. Needs sm_80+ (cp.async,
// ldmatrix, m16n8k16); built for sm_80 and sm_90.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace sdfast_csrc {

constexpr int BM = 128;
constexpr int BN = 128;
constexpr int BK = 32;
constexpr int STAGES = 3;
constexpr int THREADS = 256;
constexpr int LDS = BK + 8;  // padded shared-memory row, in halves (80 bytes)
constexpr int WARP_M = 64;   // rows per warp
constexpr int WARP_N = 32;   // columns per warp
constexpr int MT = WARP_M / 16;  // m16 tiles per warp
constexpr int NT = WARP_N / 8;   // n8 tiles per warp

constexpr int kSmemW4 = STAGES * BM * LDS * 2 + STAGES * BN * (BK / 2) + BN * LDS * 2;  // 47104 bytes

// ------------------------------------------------------------------------------------------
// PTX wrappers
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; when `valid` is false no byte is read and the 16 bytes are zeroed.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D, fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------------------
// tile loaders (cp.async) and the warp-level MMA over one BK slice
// ------------------------------------------------------------------------------------------
// A rows [m0, m0+BM) x cols [k0, k0+BK) of a row-major (rows, K) fp16 matrix -> dst[BM][LDS].
__device__ __forceinline__ void load_tile_f16(half* dst, const half* __restrict__ src, int rows, int K, int ld,
                                              int r0, int k0, int tid) {
  // BM rows x (BK / 8) 16-byte chunks = 512 chunks, 2 per thread
#pragma unroll
  for (int i = 0; i < (BM * BK / 8) / THREADS; ++i) {
    const int c = tid + i * THREADS;
    const int row = c / (BK / 8);
    const int col = (c % (BK / 8)) * 8;
    const int gr = r0 + row;
    const int gk = k0 + col;
    const bool valid = (gr < rows) && (gk < K);
    const half* g = valid ? src + static_cast<size_t>(gr) * ld + gk : src;
    cp_async_16(smem_addr(dst + row * LDS + col), g, valid);
  }
}

// One BK slice: each warp multiplies its 64 x 32 sub-tile.
__device__ __forceinline__ void mma_tile(float (&acc)[MT][NT][4], const half* As, const half* Bs, int warp_m,
                                         int warp_n, int lane) {
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    uint32_t a[MT][4];
    uint32_t b[NT / 2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row = warp_m * WARP_M + mt * 16 + (lane % 16);
      const int col = kk + (lane / 16) * 8;
      ldmatrix_x4(a[mt], smem_addr(As + row * LDS + col));
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
      const int n = warp_n * WARP_N + np * 16 + (lane / 16) * 8 + (lane % 8);
      const int col = kk + ((lane / 8) % 2) * 8;
      ldmatrix_x4(b[np], smem_addr(Bs + n * LDS + col));
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma_16816(acc[mt][nt], a[mt], b[nt / 2][(nt % 2) * 2], b[nt / 2][(nt % 2) * 2 + 1]);
      }
    }
  }
}

// fp32 accumulators (+ bias) -> fp16 C with bounds checks.
__device__ __forceinline__ void store_tile(const float (&acc)[MT][NT][4], half* __restrict__ C, const half* __restrict__ bias,
                                           int M, int N, int ldc, int m0, int n0, int warp_m, int warp_n, int lane) {
  const bool pair_ok = (N % 2 == 0) && (ldc % 2 == 0);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = n0 + warp_n * WARP_N + nt * 8 + (lane % 4) * 2;
      float b0 = 0.f, b1 = 0.f;
      if (bias != nullptr) {
        if (col < N) b0 = __half2float(bias[col]);
        if (col + 1 < N) b1 = __half2float(bias[col + 1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp_m * WARP_M + mt * 16 + (lane / 4) + h * 8;
        if (row >= M) continue;
        const float v0 = acc[mt][nt][h * 2] + b0;
        const float v1 = acc[mt][nt][h * 2 + 1] + b1;
        half* dst = C + static_cast<size_t>(row) * ldc + col;
        if (pair_ok && col + 1 < N) {
          *reinterpret_cast<half2*>(dst) = __floats2half2_rn(v0, v1);
        } else {
          if (col < N) dst[0] = __float2half_rn(v0);
          if (col + 1 < N) dst[1] = __float2half_rn(v1);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// W4A16 GEMM
// ------------------------------------------------------------------------------------------
// packed rows [n0, n0+BN) x words [k0/8, k0/8 + BK/8) -> dst[BN][BK/8] uint32 (one 16-byte chunk per row)
__device__ __forceinline__ void load_tile_w4(uint32_t* dst, const uint32_t* __restrict__ qw, int N, int KW, int n0, int k0,
                                             int tid) {
  if (tid < BN) {
    const int gn = n0 + tid;
    const int gw = k0 / 8;
    const bool valid = gn < N;
    const uint32_t* g = valid ? qw + static_cast<size_t>(gn) * KW + gw : qw;
    cp_async_16(smem_addr(dst + tid * (BK / 8)), g, valid);
  }
}

__global__ void __launch_bounds__(THREADS) gemm_w4a16_kernel(const half* __restrict__ A, const uint32_t* __restrict__ QW,
                                                              const half* __restrict__ scales,
                                                              const uint8_t* __restrict__ zeros,
                                                              const half* __restrict__ bias, half* __restrict__ C, int M,
                                                              int N, int K, int group_size, int lda, int ldc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) unsigned char smem[];
  half* As = reinterpret_cast<half*>(smem);                                 // [STAGES][BM][LDS]
  uint32_t* Bq = reinterpret_cast<uint32_t*>(As + STAGES * BM * LDS);       // [STAGES][BN][BK/8]
  half* Bs = reinterpret_cast<half*>(Bq + STAGES * BN * (BK / 8));          // [BN][LDS] dequantized
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warp_m = warp % 2;
  const int warp_n = warp / 2;
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;
  const int KT = K / BK;  // K % 32 == 0 (checked by the launcher)
  const int KW = K / 8;
  const int G = (K + group_size - 1) / group_size;

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) {
      load_tile_f16(As + s * BM * LDS, A, M, K, lda, m0, s * BK, tid);
      load_tile_w4(Bq + s * BN * (BK / 8), QW, N, KW, n0, s * BK, tid);
    }
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    // dequantize the landed int4 tile: BN rows x BK/8 words = 512 words, 2 per thread
    {
      const int s = kt % STAGES;
      const int g = (kt * BK) / group_size;  // BK divides group_size: one group per tile
#pragma unroll
      for (int i = 0; i < (BN * BK / 8) / THREADS; ++i) {
        const int w = tid + i * THREADS;
        const int n = w / (BK / 8);
        const int kw = w % (BK / 8);
        const uint32_t q = Bq[s * BN * (BK / 8) + n * (BK / 8) + kw];
        const int gn = n0 + n;
        float sc = 0.f, zf = 0.f;
        if (gn < N) {
          sc = __half2float(scales[static_cast<size_t>(gn) * G + g]);
          zf = static_cast<float>(zeros[static_cast<size_t>(gn) * G + g]);
        }
        __align__(16) half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float v0 = static_cast<float>((q >> (8 * j)) & 0xF);
          const float v1 = static_cast<float>((q >> (8 * j + 4)) & 0xF);
          h[j] = __floats2half2_rn((v0 - zf) * sc, (v1 - zf) * sc);
        }
        *reinterpret_cast<uint4*>(Bs + n * LDS + kw * 8) = *reinterpret_cast<const uint4*>(h);
      }
    }
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < KT) {
      const int s = nk % STAGES;
      load_tile_f16(As + s * BM * LDS, A, M, K, lda, m0, nk * BK, tid);
      load_tile_w4(Bq + s * BN * (BK / 8), QW, N, KW, n0, nk * BK, tid);
    }
    cp_async_commit();
    mma_tile(acc, As + (kt % STAGES) * BM * LDS, Bs, warp_m, warp_n, lane);
  }
  cp_async_wait<0>();
  store_tile(acc, C, bias, M, N, ldc, m0, n0, warp_m, warp_n, lane);
#else
  __trap();
#endif
}

}  // namespace sdfast_csrc

// ------------------------------------------------------------------------------------------
// extern "C" launchers. Return 0 on success, a cudaError_t value on a launch error, or a negative
// code for arguments the kernels do not support:
//   -1: a dimension <= 0 or a leading dimension smaller than K / N
//   -2: the leading dimension of A not a multiple of 8 (16-byte cp.async rows)
//   -3: a base pointer not 16-byte aligned
//   -4: K not a multiple of 32, or group_size not a positive multiple of 32
// ------------------------------------------------------------------------------------------
extern "C" int sdfast_gemm_w4a16(const void* A, const void* qweight, const void* scales, const void* zeros,
                                 const void* bias, void* C, int M, int N, int K, int group_size, int lda, int ldc,
                                 cudaStream_t stream) {
  using namespace sdfast_csrc;
  if (M <= 0 || N <= 0 || K <= 0 || lda < K || ldc < N) return -1;
  if (lda % 8) return -2;
  if ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(qweight)) & 15) return -3;
  if (K % 32 || group_size <= 0 || group_size % BK) return -4;
  cudaError_t err = cudaFuncSetAttribute(gemm_w4a16_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemW4);
  if (err != cudaSuccess) return static_cast<int>(err);
  dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  gemm_w4a16_kernel<<<grid, THREADS, kSmemW4, stream>>>(
      static_cast<const half*>(A), static_cast<const uint32_t*>(qweight), static_cast<const half*>(scales),
      static_cast<const uint8_t*>(zeros), static_cast<const half*>(bias), static_cast<half*>(C), M, N, K, group_size,
      lda, ldc);
  return static_cast<int>(cudaGetLastError());
}
