#!/bin/bash
# Run 18, call H (af61604): the per-tile GEGLU candidates in the engine: txt2img cold + second size (warm-up), the
# SD1.5 step profile, GEGLU and engine GPU tests.
R=$OUT/r; mkdir -p $R
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast timeout 200 python3 -c "$PYLOG" --models sd15,sdxl --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
TRITON_CACHE_DIR=/tmp/cold-triton timeout 60 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
GPU_TEST_FILES='geglu|engine' timeout 150 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img.log | head -8
grep -h "geglu_projection" $R/txt2img.log | cut -c1-260 | head -8
grep -E "GPU kernel time|geglu" $R/profile.log | head -4
tail -6 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -10
cd $OUT && tar czf r.tgz r && rm -rf r
