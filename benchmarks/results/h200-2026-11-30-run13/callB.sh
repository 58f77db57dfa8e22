R=$OUT/r; mkdir -p $R; nproc > $R/nproc.txt; nvidia-smi > $R/gpu.txt
timeout 250 python3 -m benchmarks.bench_txt2img --systems sdfast-no_fuse_qkv,sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
rm -f $R/txt2img/*.png; sed -n 3,9p $R/txt2img/txt2img.md; grep -A7 "Where one image" $R/txt2img/txt2img.md
timeout 60 python3 -m benchmarks.trace_e2e --no-stack --out $R/trace-sd15-nostack > $R/trace1.log 2>&1; grep -A30 "^call" $R/trace1.log
GPU_TEST_FILES='test_engine_gpu|test_attention_gpu' timeout 150 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -4
timeout 100 python3 -m benchmarks.profile_step --models sdxl --systems sdfast-no_fuse_qkv,sdfast --out $R/profile > $R/profile.log 2>&1; tail -30 $R/profile.log
cd $OUT && tar czf r.tgz r && rm -rf r
