R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 100 python3 benchmarks/results/h200-2026-11-30-run12/gn_fused_ab.py > $R/gn_fused_ab.txt 2>&1; cat $R/gn_fused_ab.txt | tail -12
GPU_TEST_FILES="test_norm_gpu|test_engine_gpu" timeout 150 bash benchmarks/gpu_tests.sh $R/tests | tail -4
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
grep -E "^\| sdfast" $R/txt2img.log | tail -2
rm -f $R/txt2img/*.png
timeout 80 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1
grep -E "GPU kernel" $R/profile.log
cd $OUT && tar czf r.tgz r && rm -rf r
