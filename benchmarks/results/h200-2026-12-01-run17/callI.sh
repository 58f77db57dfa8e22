R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='group_norm|test_norm_gpu|test_engine_gpu|test_user_cases_gpu' bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
tail -8 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
