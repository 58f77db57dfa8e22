#!/bin/bash
# Run 18, call C: the TMA linear GEMM's configs against cuBLAS at SD's linear shapes; the GEGLU GELU change A/B
# (3e7245a against the same tree with abgelu.patch reversed) on txt2img in one machine.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
timeout 280 python3 -m benchmarks.sweep_linear_tma --out $R/linear > $R/linear.log 2>&1; echo linear=$?
cp -r $PWD /tmp/old && (cd /tmp/old && patch -R -p1 -s < abgelu.patch) && echo reversed
for side in new old; do
  case $side in new*) D=$PWD;; old*) D=/tmp/old;; esac
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 100 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --repeats 3 --no-fp32-ref --out $R/ab-$side > $R/ab-$side.log 2>&1); echo "$side=$?"
done
tail -25 $R/linear.log
grep -hE "/sdfast\] e2e" $R/ab-*.log
cd $OUT && tar czf r.tgz r && rm -rf r
