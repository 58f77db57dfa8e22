set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $R/smi.txt
python3 -c "
import time; t=time.time()
from kernels.norm import group_norm_cluster as g
g.library(); print('build_s', round(time.time()-t,1))
from kernels.norm.group_norm_cluster import candidate_plans, max_active_clusters, TUNING
TUNING['max_cluster']=16
for s in [(2,320,4096),(2,960,4096),(2,320,16384)]:
    for p in candidate_plans(s[0],s[1],s[2],32,2):
        if p.K==16: print(s, p, 'max_active', max_active_clusters(p, s[1], 32, __import__('torch').float16)); break
" 2>&1 | tee $R/build.log
GPU_TEST_FILES='test_group_norm_cluster_gpu|test_norm_gpu' timeout 200 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -6
grep -E "FAILED|Error|error" $R/tests/tests-test_group_norm_cluster_gpu.log | head -30
timeout 150 python3 -m benchmarks.bench_group_norm_cluster --out $R/bench --sweep > $R/bench.log 2>&1; echo bench=$?
head -60 $R/bench.log; tail -5 $R/bench.log
export SDFAST_GN_CLUSTER=0
timeout 100 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
unset SDFAST_GN_CLUSTER
timeout 100 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast --out $R/txt2img-on > $R/txt2img-on.log 2>&1; echo on=$?
grep -h "sd15/sdfast" $R/txt2img-off.log $R/txt2img-on.log
cd $OUT && tar czf r.tgz r && rm -rf r
