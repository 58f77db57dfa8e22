R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='test_engine_gpu|test_user_cases_gpu|test_attention_gpu|test_gpu_service' timeout 220 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -8
cd $OUT && tar czf r.tgz r && rm -rf r
