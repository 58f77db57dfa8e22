set -x
R=$OUT/r; mkdir -p $R
T=.cslt-tools
# 1. cuSPARSELt: which copy does the process's global scope (what libtorch binds to) give, with 0.8.1 preloaded?
OLD=$(python3 -c 'import torch; print([l.split()[-1] for l in open("/proc/self/maps") if "libcusparseLt" in l][0])')
mkdir -p .cslt && cp $OLD .cslt/old.so && python3 $T/strip_fatbin.py .cslt/old.so 90 > /dev/null
LD_LIBRARY_PATH=$T $T/zstd -d -q --long=28 --patch-from=.cslt/old.so $T/p081.zst -o .cslt/libcusparseLt.so.0 -f
sha256sum .cslt/libcusparseLt.so.0 | tee $R/cslt.txt
CHK='import torch, ctypes; torch.zeros(1, device="cuda"); from kernels.gemm.sparse24 import cusparselt_runtime_version as v, _loaded_library as L; g = ctypes.CDLL(None); print("global scope:", v(), "| first mapped:", L("libcusparseLt.so")); import torch.nn.functional as F; w = torch.randn(256, 256, device="cuda", dtype=torch.float16); w = w * (torch.arange(256, device="cuda") % 4 < 2); y = torch._cslt_sparse_mm(torch._cslt_compress(w), torch.randn(256, 64, device="cuda", dtype=torch.float16)); print("cslt ok", tuple(y.shape))'
python3 -c "$CHK" 2>&1 | tee -a $R/cslt.txt
LD_PRELOAD=$PWD/.cslt/libcusparseLt.so.0 python3 -c "$CHK" 2>&1 | tee -a $R/cslt.txt
LD_PRELOAD=$PWD/.cslt/libcusparseLt.so.0 LD_DEBUG=bindings timeout 120 python3 -c "$CHK" 2>&1 | grep -m3 "cusparseLtMatmul'" | tee -a $R/cslt.txt
date
# 2. GPU tests of the norm kernels (the new sync path included)
GPU_TEST_FILES='test_norm_gpu' timeout 200 bash benchmarks/gpu_tests.sh $R/tests
date
# 3. GroupNorm: the sync path's knobs, then the norm section
timeout 170 python3 -m benchmarks.tune_group_norm --out $R/tune --knobs sync,sync_max_elems,sync_warps --budget-s 130 2>&1 | tail -40
date
timeout 100 python3 -m benchmarks.bench_kernels --only norm --quick --out $R/norm 2>&1 | tail -45
date
tar czf $OUT/results.tgz -C $OUT r
