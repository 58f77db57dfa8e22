R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)" >> $R/gpu.txt
git log --oneline -1 >> $R/gpu.txt 2>&1
timeout 170 python3 -m pytest -q -m gpu tests/kernels/geglu tests/kernels/norm -k "fp8 or projection" -p no:cacheprovider > $R/tests.log 2>&1; echo tests rc $? >> $R/gpu.txt
timeout 120 python3 -m benchmarks.ops.geglu fp8 --extra --out $R/geglu > $R/geglu.log 2>&1; echo geglu rc $? >> $R/gpu.txt
for m in sdxl sd15; do
  timeout 150 python3 -m benchmarks.bench_txt2img --models $m --systems sdfast-fp8-static-convs --no-fp32-ref --profile --out $R/${m}_on > $R/${m}_on.log 2>&1; echo $m on rc $? >> $R/gpu.txt
  SDFAST_FP8_GEGLU=0 timeout 150 python3 -m benchmarks.bench_txt2img --models $m --systems sdfast-fp8-static-convs --no-fp32-ref --profile --out $R/${m}_off > $R/${m}_off.log 2>&1; echo $m off rc $? >> $R/gpu.txt
done
tar czf $OUT/r.tgz -C $OUT r
