set -x
R=$OUT/r; mkdir -p $R
python3 -c "
import time; t=time.time()
from kernels.norm import group_norm_cluster as g
g.library(); print('build_s', round(time.time()-t,1))" 2>&1 | tee $R/build.log
GPU_TEST_FILES='test_group_norm_cluster_gpu' timeout 120 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -3
grep -E "FAILED|SKIPPED|^E " $R/tests/tests-test_group_norm_cluster_gpu.log | head -30
timeout 150 python3 -m benchmarks.bench_group_norm_cluster --out $R/bench > $R/bench.log 2>&1; echo bench=$?
grep -E "^\| 2x|^\| 1x" $R/bench.log | awk -F'|' '{print $2,$3,$4,$6,$8,$9,$10,$11,$12}'
export SDFAST_GN_CLUSTER=0
timeout 100 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
unset SDFAST_GN_CLUSTER
timeout 100 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast --out $R/txt2img-on > $R/txt2img-on.log 2>&1; echo on=$?
grep -h "sd15/sdfast" $R/txt2img-off.log $R/txt2img-on.log
cd $OUT && tar czf r.tgz r && rm -rf r
