R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='group_norm|test_norm_gpu|test_engine_gpu' bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
python3 - > $R/gn.log 2>&1 <<'PY'
import torch
from benchmarks.kernel_benches.device_time import device_time_us
from kernels.norm import group_norm
for fmt, name in ((torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 320, 64, 64, device="cuda", generator=g) * 2 + 0.5).half().contiguous(memory_format=fmt)
    w = (torch.randn(320, device="cuda", generator=g) * 0.5 + 1).half(); b = torch.randn(320, device="cuda", generator=g).half()
    fn = lambda: group_norm(x, 32, w, b, 1e-5, activation="silu")
    fn()
    print(f"GroupNorm+SiLU (2, 320, 64, 64) {name}: {device_time_us(fn):.2f} us")
PY
cat $R/gn.log | grep GroupNorm; tail -8 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
