R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 250 python3 -m benchmarks.bench_txt2img --systems sdfast-no_conv_bias,sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "^\| sdfast" $R/txt2img.log | tail -4
rm -f $R/txt2img/*.png
timeout 100 python3 -m benchmarks.profile_step --models sd15,sdxl --systems sdfast --vae --out $R/profile > $R/profile.log 2>&1
grep -E "GPU kernel" $R/profile.log
timeout 230 bash benchmarks/gpu_tests.sh $R/tests | tail -22
cd $OUT && tar czf r.tgz r && rm -rf r
