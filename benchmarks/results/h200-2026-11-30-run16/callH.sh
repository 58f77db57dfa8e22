set -x
R=$OUT/r; mkdir -p $R
GPU_TEST_FILES='conv3x3|geglu_tma|test_engine_gpu|precompile' timeout 200 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
tail -8 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
timeout 90 python3 -c "$PYLOG" --models sd15 --systems sdfast --out $R/txt2img > $R/txt2img.log 2>&1; echo on=$?
grep -hE "/sdfast\] e2e" $R/txt2img.log; grep -h "conv3x3 x\|geglu_projection x" $R/txt2img.log | head -4 | cut -c1-200
cd $OUT && tar czf r.tgz r && rm -rf r
