R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='test_geglu_tma_gpu|test_group_norm_cluster_gpu' timeout 120 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?; tail -5 $R/tests.log
cd $OUT && tar czf r.tgz r && rm -rf r
