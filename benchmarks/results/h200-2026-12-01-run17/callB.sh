R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
GPU_TEST_FILES='group_norm|test_norm_gpu' bash benchmarks/gpu_tests.sh $R/tests > $R/tests.txt 2>&1
python3 -c "import logging,runpy,sys; logging.basicConfig(level=logging.INFO); sys.argv=['p']; runpy.run_path('probe_gn_sweep.py', run_name='__main__')" > $R/probe.log 2>&1
timeout 240 python3 -m benchmarks.bench_kernels --only norm --out $R/kernels > $R/kernels.log 2>&1; tail -3 $R/kernels.log
grep -v "^INFO\|^DEBUG\|Warn\|warn" $R/probe.log | tail -70
grep "group_norm_silu | 2x320x64x64\|group_norm | 2x320x64x64" $R/kernels/kernels.md
cat $R/tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
