R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)" >> $R/gpu.txt
timeout 150 python3 -m benchmarks.ops.quant report --models sd15,sdxl --out $R/report > $R/report.log 2>&1; echo report rc $? >> $R/gpu.txt
timeout 200 python3 -m pytest -q -m gpu tests/kernels/geglu tests/kernels/norm tests/kernels/conv tests/kernels/gemm -p no:cacheprovider -x > $R/tests.log 2>&1; echo tests rc $? >> $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
