R=$OUT/r; mkdir -p $R
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "e2e|first image" $R/txt2img.log | tail -8; grep -E "^\| (sd15|sdxl)/sdfast" $R/txt2img/txt2img.md
rm -f $R/txt2img/*.png $R/txt2img/*.csv
timeout 60 python3 callA_gn.py > $R/gn_breakdown.txt 2>&1; grep -E "total|NHWC|NCHW" $R/gn_breakdown.txt | cut -c1-40
timeout 90 python3 -m benchmarks.profile_warmup --model random:sd15 --cold --second-size --out $R/ss-sd15 > /dev/null 2>&1
rm -f $R/ss-sd15/warmup.pstats; head -3 $R/ss-sd15/warmup.txt; grep -A8 "compiled in the profiled" $R/ss-sd15/warmup.txt
GPU_TEST_FILES='test_norm_gpu|test_engine_gpu' timeout 150 bash benchmarks/gpu_tests.sh $R/tests | tail -5
rm -f $R/tests/junit*
