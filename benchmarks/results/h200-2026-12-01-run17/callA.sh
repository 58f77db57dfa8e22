set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
python3 -c "import logging,runpy,sys; logging.basicConfig(level=logging.INFO); sys.argv=['p']; runpy.run_path('probe_gn_nchw.py', run_name='__main__')" > $R/probe.log 2>&1
GPU_TEST_FILES='group_norm|test_norm_gpu' bash benchmarks/gpu_tests.sh $R/tests > $R/tests.txt 2>&1
grep -v "^INFO\|^DEBUG" $R/probe.log | tail -80
cat $R/tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
