set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/smi.txt
timeout 130 python3 -m benchmarks.sweep_geglu_tma --out $R/sweep > $R/sweep.log 2>&1; echo sweep=$?
grep -E "^sd|^\| s" $R/sweep.log | tail -14
GPU_TEST_FILES='test_geglu_tma_gpu|test_group_norm_cluster_gpu' timeout 110 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
tail -4 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -12
timeout 140 python3 -c "import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))" --models sd15,sdxl --systems sdfast --out $R/txt2img-on > $R/txt2img-on.log 2>&1; echo on=$?
grep -hE "/sdfast\] e2e|^\| sdfast" $R/txt2img-on.log | head -6; grep -h "geglu_projection" $R/txt2img-on.log | head -12
SDFAST_GEGLU_TMA=0 timeout 130 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
grep -hE "/sdfast\] e2e|^\| sdfast" $R/txt2img-off.log | head -6
cd $OUT && tar czf r.tgz r && rm -rf r
