R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast timeout 200 python3 -c "$PYLOG" --models sd15,sdxl --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1; echo txt2img=$?
timeout 250 bash benchmarks/gpu_tests.sh $R/tests > $R/tests.log 2>&1; echo tests=$?
timeout 110 python3 -m benchmarks.bench_kernels --only norm --out $R/kernels > $R/kernels.log 2>&1; echo kernels=$?
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img.log | head -8
grep "group_norm_silu | 2x320x64x64" $R/kernels/kernels.md
tail -20 $R/tests.log; grep -hE "^FAILED|^E  " $R/tests/tests-*.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
