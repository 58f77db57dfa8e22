R=$OUT/r; mkdir -p $R
TRITON_CACHE_DIR=/tmp/cold-triton SDFAST_CACHE_DIR=/tmp/cold-sdfast timeout 240 python3 -m benchmarks.profile_warmup --model random:sdxl --cold --second-size --out $R/warmup-sdxl > $R/warmup-sdxl.log 2>&1
head -60 $R/warmup-sdxl/warmup.txt
cd $OUT && tar czf r.tgz r && rm -rf r
