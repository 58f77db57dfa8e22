R=$OUT/r; mkdir -p $R; nproc > $R/nproc.txt; nvidia-smi > $R/gpu.txt
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
rm -f $R/txt2img/*.png; sed -n 3,7p $R/txt2img/txt2img.md; grep -A5 "Where one image" $R/txt2img/txt2img.md
GPU_TEST_FILES='test_engine_gpu|test_user_cases_gpu|test_norm_gpu|test_gpu_service' timeout 200 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -8
timeout 50 python3 -m benchmarks.trace_e2e --no-stack --out $R/trace-sd15-nostack > $R/trace1.log 2>&1; grep -A16 "^call" $R/trace1.log
timeout 110 python3 -m benchmarks.profile_step --models sd15,sdxl --systems sdfast --out $R/profile > $R/profile.log 2>&1; grep -B2 -A22 "GPU kernel time per step" $R/profile.log | grep -v "^|.*sdfast:" | head -40
cd $OUT && tar czf r.tgz r && rm -rf r
