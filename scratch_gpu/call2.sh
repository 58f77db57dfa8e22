R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)" >> $R/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/kernels/geglu tests/kernels/norm -k "fp8 or projection" -p no:cacheprovider > $R/tests.log 2>&1; echo tests rc $? >> $R/gpu.txt
timeout 100 python3 -m benchmarks.ops.geglu fp8 --extra --out $R/geglu > $R/geglu.log 2>&1; echo geglu rc $? >> $R/gpu.txt
timeout 120 python3 -m benchmarks.bench_txt2img --models sdxl --systems sdfast-fp8-static-convs --no-fp32-ref --profile --out $R/sdxl_on > $R/sdxl_on.log 2>&1; echo sdxl on rc $? >> $R/gpu.txt
timeout 240 python3 -m benchmarks.bench_txt2img --preset throughput-sdxl --out $R/tp_sdxl > $R/tp_sdxl.log 2>&1; echo tp sdxl rc $? >> $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
