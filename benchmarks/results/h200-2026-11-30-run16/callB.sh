set -x
R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='conv3x3' timeout 120 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
tail -6 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
timeout 150 python3 -m benchmarks.sweep_conv --out $R/sweep > $R/sweep.log 2>&1; echo sweep=$?
grep "^| sd\|^- " $R/sweep.log
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
SDFAST_CONV_GEMM=0 timeout 90 python3 -c "$PYLOG" --models sd15 --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
timeout 150 python3 -c "$PYLOG" --models sd15,sdxl --systems sdfast --out $R/txt2img > $R/txt2img.log 2>&1; echo on=$?
grep -hE "/sdfast\] e2e|^\| sdfast" $R/txt2img-off.log $R/txt2img.log | head -8; grep -h "conv3x3 x" $R/txt2img.log | cut -c1-220
cd $OUT && tar czf r.tgz r && rm -rf r
