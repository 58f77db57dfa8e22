#!/bin/bash
# Run 18, call B (3e7245a): the GEGLU GEMM with the new GELU epilogue (sweep), txt2img cold + second size, the SD1.5
# step profile, and the GPU tests of the changed kernels and the engine.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
timeout 100 python3 -m benchmarks.sweep_geglu_tma --out $R/geglu > $R/geglu.log 2>&1; echo geglu=$?
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast timeout 200 python3 -c "$PYLOG" --models sd15,sdxl --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
timeout 60 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
GPU_TEST_FILES='geglu|norm_gpu|gemm_gpu|engine' timeout 200 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
cat $R/geglu.log
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img.log | head -8
grep -E "GPU kernel time|geglu" $R/profile.log | head -5
tail -8 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
