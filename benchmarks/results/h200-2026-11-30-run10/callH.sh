R=$OUT/r; mkdir -p $R
timeout 150 python3 -m benchmarks.bench_txt2img --systems sdfast --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "e2e|first image" $R/txt2img.log | tail -4
GPU_TEST_FILES='test_engine_gpu' timeout 110 bash benchmarks/gpu_tests.sh $R/tests
rm -f $R/txt2img/txt2img.png
