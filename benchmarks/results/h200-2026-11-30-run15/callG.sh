set -x
R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='test_geglu_tma_gpu|test_engine_gpu|test_user_cases_gpu|test_precompile_gpu' timeout 200 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
tail -7 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -12
timeout 140 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
grep -hE "/sdfast\] e2e|^\| sdfast" $R/txt2img.log | head -4
cd $OUT && tar czf r.tgz r && rm -rf r
