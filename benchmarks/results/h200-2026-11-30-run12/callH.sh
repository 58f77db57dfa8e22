R=$OUT/r; mkdir -p $R
timeout 120 python3 -m benchmarks.sweep_attention --out $R/sweep --only "sdxl cross,sd21" 2>&1 | grep -v Warning | tee $R/sweep.log | grep -v "^   "
GPU_TEST_FILES="test_engine_gpu|test_concat_gpu" timeout 120 bash benchmarks/gpu_tests.sh $R/tests | tail -4
cd $OUT && tar czf r.tgz r && rm -rf r
