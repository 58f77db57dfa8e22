R=$OUT/r; mkdir -p $R
git log -1 --format=%h > $R/commit.txt 2>/dev/null
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "e2e|first image" $R/txt2img.log | tail -8; grep -E "^\| (sd15|sdxl)/sdfast|^\| sdfast" $R/txt2img/txt2img.md
rm -f $R/txt2img/*.png $R/txt2img/*.csv
timeout 60 python3 callA_gn.py > $R/gn_breakdown.txt 2>&1; grep -E "total" $R/gn_breakdown.txt | tr '\n' ' '; echo
timeout 100 python3 -m benchmarks.bench_kernels --only norm --quick --out $R/kernels > $R/kernels.log 2>&1; tail -3 $R/kernels.log
timeout 230 bash benchmarks/gpu_tests.sh $R/tests | tail -16
cd $OUT && tar czf r.tgz r && rm -rf r
