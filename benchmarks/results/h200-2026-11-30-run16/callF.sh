set -x
R=$OUT/r; mkdir -p $R
SDFAST_CONV_GEMM=0 timeout 150 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
timeout 150 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img-on > $R/txt2img-on.log 2>&1; echo on=$?
grep -hE "/sdfast\] e2e" $R/txt2img-off.log $R/txt2img-on.log
timeout 120 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
grep -A30 "GPU kernel time per step" $R/profile.log | head -34
cd $OUT && tar czf r.tgz r && rm -rf r
