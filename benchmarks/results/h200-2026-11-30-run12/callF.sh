R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "^\| sdfast" $R/txt2img.log | tail -2
rm -f $R/txt2img/*.png
timeout 100 python3 -m benchmarks.profile_step --models sd15,sdxl --systems sdfast --out $R/profile > $R/profile.log 2>&1
grep -E "GPU kernel" $R/profile.log
GPU_TEST_FILES="test_attention_gpu|test_engine_gpu" timeout 170 bash benchmarks/gpu_tests.sh $R/tests | tail -4
cd $OUT && tar czf r.tgz r && rm -rf r
