#!/bin/bash
# Run 18, call D: txt2img cold + second size with the small-K linear pass; the pass A/B on SD1.5 (SDFAST_LINEAR_TMA
# 1 against 0, alternating, one machine); the SD1.5 step profile; GPU tests of the new kernel, the GEGLU and the engine.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
export TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast
timeout 200 python3 -c "$PYLOG" --models sd15,sdxl --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
for side in on off on2 off2; do
  case $side in on*) V=1;; off*) V=0;; esac
  SDFAST_LINEAR_TMA=$V timeout 60 python3 -m benchmarks.bench_txt2img --models sd15 --systems sdfast --repeats 3 --no-fp32-ref --out $R/ab-$side > $R/ab-$side.log 2>&1; echo "$side=$?"
done
timeout 60 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
GPU_TEST_FILES='linear|geglu|engine' timeout 200 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img.log | head -8
grep -h "linear_projection" $R/txt2img.log | head -12
grep -hE "/sdfast\] e2e" $R/ab-*.log
grep -E "GPU kernel time|nvjet|_linear_tma|bias_residual|geglu" $R/profile.log | head -14
tail -8 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
