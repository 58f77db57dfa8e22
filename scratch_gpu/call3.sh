R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)" >> $R/gpu.txt
timeout 100 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast-fp8-static-convs --no-fp32-ref --profile --out $R/sd15_on > $R/sd15_on.log 2>&1; echo sd15 on rc $? >> $R/gpu.txt
SDFAST_FP8_GEGLU=0 timeout 100 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast-fp8-static-convs --no-fp32-ref --out $R/sd15_off > $R/sd15_off.log 2>&1; echo sd15 off rc $? >> $R/gpu.txt
timeout 150 python3 -m benchmarks.bench_txt2img --preset throughput-sd15 --out $R/tp_sd15 > $R/tp_sd15.log 2>&1; echo tp sd15 rc $? >> $R/gpu.txt
timeout 130 python3 -m benchmarks.bench_txt2img --preset throughput-sdxl --systems sdfast-fp8-static-convs-vae_bf16 --out $R/tp_sdxl_vae > $R/tp_sdxl_vae.log 2>&1; echo tp sdxl vae rc $? >> $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
