set -x
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/smi.txt
PYLOG="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast timeout 170 python3 -c "$PYLOG" --models sd15,sdxl --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1; echo on=$?
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img.log | head -8; grep -h "geglu_projection" $R/txt2img.log | cut -c1-200
SDFAST_GEGLU_TMA=0 timeout 130 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img-off > $R/txt2img-off.log 2>&1; echo off=$?
grep -hE "/sdfast\] e2e|^\| sdfast" $R/txt2img-off.log | head -6
timeout 90 python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
grep -E "GPU kernel time|geglu|GEMM|conv|attention" $R/profile.log | head -12
cd $OUT && tar czf r.tgz r && rm -rf r
