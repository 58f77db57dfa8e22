R=$OUT/r; mkdir -p $R
git log -1 --format=%h > $R/commit.txt 2>/dev/null
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "e2e|first image|step" $R/txt2img.log | tail -8
rm -f $R/txt2img/*.png
timeout 40 python3 callA_gn.py > $R/gn_breakdown.txt 2>&1; grep -E "total|NHWC|NCHW" $R/gn_breakdown.txt | cut -c1-40
for m in sd15 sdxl; do
  timeout 90 python3 -m benchmarks.profile_warmup --model random:$m --cold --second-size --out $R/ss-$m > /dev/null 2>&1
  rm -f $R/ss-$m/warmup.pstats; head -10 $R/ss-$m/warmup.txt; grep -A8 "compiled in the profiled" $R/ss-$m/warmup.txt
done
GPU_TEST_FILES='test_norm_gpu|test_attention_gpu|test_engine_gpu' timeout 200 bash benchmarks/gpu_tests.sh $R/tests
