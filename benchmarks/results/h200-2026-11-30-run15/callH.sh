R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='test_geglu_tma_gpu' timeout 60 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?; tail -3 $R/tests.log
timeout 100 python3 -m benchmarks.sweep_geglu_tma --out $R/sweep > $R/sweep.log 2>&1; echo sweep=$?; grep -E "^\| s" $R/sweep.log
cd $OUT && tar czf r.tgz r && rm -rf r
