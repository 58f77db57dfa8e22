R=$OUT/r; mkdir -p $R; nproc > $R/nproc.txt
timeout 150 python3 -m benchmarks.sweep_geglu --out $R/geglu > $R/geglu.log 2>&1; tail -14 $R/geglu.log
timeout 70 python3 -m benchmarks.trace_e2e --out $R/trace-sd15-stack > $R/trace2.log 2>&1; grep -A22 "^call" $R/trace2.log | cut -c1-400
timeout 300 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -22
cd $OUT && tar czf r.tgz r && rm -rf r
