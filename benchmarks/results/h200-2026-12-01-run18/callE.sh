#!/bin/bash
# Run 18, call E (final code): every GPU test file; the SDXL step profile.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
timeout 300 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
timeout 150 python3 -m benchmarks.profile_step --models sdxl --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
tail -30 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
grep -E "GPU kernel time|geglu|linear|GEMM|attention|conv" $R/profile.log | head -12
cd $OUT && tar czf r.tgz r && rm -rf r
