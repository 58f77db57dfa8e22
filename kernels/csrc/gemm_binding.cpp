// Torch binding for gemm_cp_async.cu (built together by kernels/csrc/build.py with
// torch.utils.cpp_extension.load). The .cu stays pure CUDA: it exposes extern "C" launchers, and
// only this file sees torch headers.

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

extern "C" int sdfast_gemm_w4a16(const void* A, const void* qweight, const void* scales, const void* zeros,
                                 const void* bias, void* C, int M, int N, int K, int group_size, int lda, int ldc,
                                 cudaStream_t stream);

static void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc != -1, what, ": a dimension is <= 0 or a leading dimension is too small");
  TORCH_CHECK(rc != -2, what, ": the row stride of a must be a multiple of 8 (16-byte cp.async rows)");
  TORCH_CHECK(rc != -3, what, ": base pointers must be 16-byte aligned");
  TORCH_CHECK(rc != -4, what, ": W4A16 needs K % 32 == 0 and group_size a positive multiple of 32");
  TORCH_CHECK(rc == 0, what, ": CUDA error ", rc, " (", cudaGetErrorString(static_cast<cudaError_t>(rc)), ")");
}

// a: (M, K) fp16; qweight: int32 (N, K/8); scales: fp16 (N, G); zeros: uint8 (N, G); bias: (N,) fp16 or None.
torch::Tensor gemm_w4a16(torch::Tensor a, torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros,
                         c10::optional<torch::Tensor> bias, int64_t group_size) {
  TORCH_CHECK(a.is_cuda() && qweight.is_cuda(), "gemm_w4a16: CUDA tensors expected");
  TORCH_CHECK(a.scalar_type() == at::kHalf && a.dim() == 2 && a.stride(1) == 1, "gemm_w4a16: a (M, K) fp16, unit K stride");
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.is_contiguous(), "gemm_w4a16: qweight int32 contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "gemm_w4a16: scales fp16 contiguous");
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous(), "gemm_w4a16: zeros uint8 contiguous");
  const c10::cuda::CUDAGuard guard(a.device());
  const int M = a.size(0), K = a.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 8 == K, "gemm_w4a16: qweight must be (N, K/8)");
  auto c = torch::empty({M, N}, a.options());
  const void* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kHalf && bias->numel() == N && bias->is_contiguous(), "gemm_w4a16: bias (N,) fp16");
    bp = bias->data_ptr();
  }
  check_rc(sdfast_gemm_w4a16(a.data_ptr(), qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), bp, c.data_ptr(), M,
                             N, K, static_cast<int>(group_size), a.stride(0), N, c10::cuda::getCurrentCUDAStream().stream()),
           "gemm_w4a16");
  return c;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_w4a16", &gemm_w4a16, "W4A16 GEMM, packed int4 weight dequantized in shared memory");
}
