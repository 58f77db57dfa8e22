R=$OUT/r; mkdir -p $R
timeout 150 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "e2e|first image" $R/txt2img.log | tail -6
rm -f $R/txt2img/*.png $R/txt2img/*.csv
timeout 50 python3 benchmarks/results/h200-2026-11-30-run11/gn_breakdown.py > $R/gn_breakdown.txt 2>&1; grep -E "total" $R/gn_breakdown.txt | tr '\n' ' '; echo
GPU_TEST_FILES="test_norm_gpu|test_attention_gpu" timeout 120 bash benchmarks/gpu_tests.sh $R/tests | tail -6
cd $OUT && tar czf r.tgz r && rm -rf r
