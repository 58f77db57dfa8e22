R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout 480 python3 -m benchmarks.sweep_attention --out $R/sweep 2>&1 | grep -v Warning | tee $R/sweep.log | tail -60
cd $OUT && tar czf r.tgz r && rm -rf r
