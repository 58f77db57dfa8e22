set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/smi.txt
TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast timeout 150 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
grep -hE "^\| sdfast|/sdfast\] e2e|first image" $R/txt2img.log | head -8
SDFAST_GN_CLUSTER=0 timeout 80 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
grep -h "sd15/sdfast\] e2e" $R/txt2img-off.log
timeout 80 python3 -m benchmarks.bench_group_norm_cluster --out $R/bench > $R/bench.log 2>&1; echo bench=$?
grep -E "^\| 2x|^\| 1x" $R/bench.log | awk -F'|' '{print $2,$3,$4,$6,$8,$9,$10,$11,$12}'
timeout 250 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -30
grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
