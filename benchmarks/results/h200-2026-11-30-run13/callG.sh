R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='test_engine_gpu|test_upsample_gpu|test_concat_gpu|test_bias_residual_gpu' timeout 150 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -7
cd $OUT && tar czf r.tgz r && rm -rf r
