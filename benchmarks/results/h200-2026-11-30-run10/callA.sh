set -x
R=$OUT/r; mkdir -p $R
T=.cslt-tools
VER='import ctypes,torch; p=[l.split()[-1] for l in open("/proc/self/maps") if "libcusparseLt" in l]; print(sorted(set(p))); from kernels.gemm.sparse24 import cusparselt_runtime_version as v; print("runtime", v(), "built", torch.backends.cusparselt.version())'
OLD=$(python3 -c 'import torch; print([l.split()[-1] for l in open("/proc/self/maps") if "libcusparseLt" in l][0])')
sha256sum $OLD | tee $R/cslt.txt
mkdir -p .cslt && cp $OLD .cslt/old.so && python3 $T/strip_fatbin.py .cslt/old.so 90 > /dev/null
LD_LIBRARY_PATH=$T $T/zstd -d -q --long=28 --patch-from=.cslt/old.so $T/p081.zst -o .cslt/libcusparseLt.so.0 -f
sha256sum .cslt/libcusparseLt.so.0 | tee -a $R/cslt.txt
NEW=$PWD/.cslt/libcusparseLt.so.0
python3 -c "$VER" 2>&1 | tee -a $R/cslt.txt
LD_PRELOAD=$NEW python3 -c "$VER" 2>&1 | tee -a $R/cslt.txt
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a $R/cslt.txt
date
timeout 120 python3 -m benchmarks.sweep_cusparselt --out $R/s080q --dtypes fp16 --quick --shape-timeout 40 2>&1 | tail -14
date
LD_PRELOAD=$NEW timeout 260 python3 -m benchmarks.sweep_cusparselt --out $R/s081 --dtypes fp16,fp8 --shape-timeout 60 2>&1 | tail -24
date
GPU_TEST_FILES='test_upsample_gpu|test_sparse24_gpu' LD_PRELOAD=$NEW timeout 110 bash benchmarks/gpu_tests.sh $R/tests
date
tar czf $OUT/results.tgz -C $OUT r
