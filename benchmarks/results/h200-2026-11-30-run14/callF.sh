set -x
R=$OUT/r; mkdir -p $R
timeout 90 python3 -m benchmarks.bench_group_norm_cluster --out $R/bench > $R/bench.log 2>&1; echo bench=$?
grep -E "^\| 2x|^\| 1x" $R/bench.log | awk -F'|' '{print $2,$3,$4,$7,$8,$9,$11,$12}'
timeout 120 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
grep -hE "/sdfast\] e2e|first image" $R/txt2img.log
timeout 80 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
grep -iE "group|norm|total|kernels" $R/profile.log | head -12
GPU_TEST_FILES='test_group_norm_cluster_gpu|test_norm_gpu|test_engine_gpu' timeout 120 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -6
cd $OUT && tar czf r.tgz r && rm -rf r
