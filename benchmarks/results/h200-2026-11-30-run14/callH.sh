set -x
R=$OUT/r; mkdir -p $R
python3 -c "
import time; t=time.time()
from kernels.norm import group_norm_cluster as g
g.library(); print('build_s', round(time.time()-t,1))
import torch
from benchmarks.kernel_benches.device_time import device_time_us
from benchmarks.bench_group_norm_cluster import _inputs
for shape in [(2,320,64,64),(2,640,32,32),(2,1280,32,32)]:
    x,w,b,_,_=_inputs(shape, False); y=torch.empty_like(x)
    print(shape, 'cluster_us', round(device_time_us(lambda: g.try_group_norm(x,32,w,b,1e-5,None,None,True,y,None)),2))
" 2>&1 | tee $R/check.log
GPU_TEST_FILES='test_group_norm_cluster_gpu|test_norm_gpu' timeout 100 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -5
grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -10
cd $OUT && tar czf r.tgz r && rm -rf r
