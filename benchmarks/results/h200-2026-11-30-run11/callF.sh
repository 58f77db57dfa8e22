R=$OUT/r; mkdir -p $R
git log -1 --format=%h > $R/commit.txt 2>/dev/null
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "e2e|first image" $R/txt2img.log | tail -8; grep -E "^\| (sd15|sdxl)/sdfast|^\| sdfast" $R/txt2img/txt2img.md
rm -f $R/txt2img/*.png $R/txt2img/*.csv
timeout 80 python3 -m benchmarks.profile_warmup --model random:sd15 --cold --second-size --out $R/ss-sd15 > /dev/null 2>&1; rm -f $R/ss-sd15/warmup.pstats; grep -A6 "compiled in the profiled" $R/ss-sd15/warmup.txt
GPU_TEST_FILES="test_attention_gpu|test_engine_gpu|test_user_cases_gpu" timeout 200 bash benchmarks/gpu_tests.sh $R/tests | tail -16
cd $OUT && tar czf r.tgz r && rm -rf r
