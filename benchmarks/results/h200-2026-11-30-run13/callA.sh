R=$OUT/r; mkdir -p $R; nproc > $R/nproc.txt; nvidia-smi > $R/gpu.txt
timeout 60 python3 -m benchmarks.bench_qkv --out $R/qkv > $R/qkv.log 2>&1; tail -8 $R/qkv.log
timeout 230 python3 -m benchmarks.bench_txt2img --systems sdfast,sdfast-fuse_qkv --out $R/txt2img > $R/txt2img.log 2>&1
rm -f $R/txt2img/*.png; tail -30 $R/txt2img/txt2img.md
timeout 90 python3 -m benchmarks.trace_e2e --no-stack --out $R/trace-sd15-nostack > $R/trace1.log 2>&1; tail -30 $R/trace1.log
timeout 90 python3 -m benchmarks.trace_e2e --out $R/trace-sd15-stack > $R/trace2.log 2>&1; tail -30 $R/trace2.log
cd $OUT && tar czf r.tgz r && rm -rf r
