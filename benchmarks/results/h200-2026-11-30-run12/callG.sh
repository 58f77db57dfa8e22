R=$OUT/r; mkdir -p $R; nproc > $R/nproc.txt
timeout 170 python3 -m benchmarks.bench_txt2img --systems sdfast --second-size --out $R/txt2img > $R/txt2img.log 2>&1
rm -f $R/txt2img/*.png
