set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
GPU_TEST_FILES=conv3x3 timeout 150 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
timeout 280 python3 -m benchmarks.sweep_conv_tma --extra --models sd15 --out $R/sweep15 > $R/sweep15.log 2>&1; echo sweep15=$?

tail -5 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
timeout 120 python3 -m benchmarks.sweep_conv_tma --models sdxl --out $R/sweepxl > $R/sweepxl.log 2>&1; echo sweepxl=$?
grep -v "^|" $R/sweep15.log | tail -20; grep "^| sd" $R/sweep15.log; grep "^- " $R/sweep15.log
grep "^| sd" $R/sweepxl.log; grep "^- " $R/sweepxl.log; tail -3 $R/sweepxl.log
cd $OUT && tar czf r.tgz r && rm -rf r
