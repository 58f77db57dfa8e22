R=$OUT/r; mkdir -p $R; nproc > $R/nproc.txt; nvidia-smi > $R/gpu.txt
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
rm -f $R/txt2img/*.png; sed -n 3,7p $R/txt2img/txt2img.md; grep -A5 "Where one image" $R/txt2img/txt2img.md
GPU_TEST_FILES='test_engine_gpu|test_user_cases_gpu|test_attention_gpu' timeout 200 bash benchmarks/gpu_tests.sh $R/tests 2>&1 | tail -7
cd $OUT && tar czf r.tgz r && rm -rf r
