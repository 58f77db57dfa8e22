#!/bin/bash
# Run 18, call F: why SDXL's step gained less than its GEGLU timings predict: the SDXL step profile with the GELU
# change reversed (abgelu.patch, "old") and at the current code ("new"), one machine.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/smi.txt
cp -r $PWD /tmp/old && (cd /tmp/old && patch -R -p1 -s < abgelu.patch) && echo reversed
for side in old new; do
  case $side in new) D=$PWD;; old) D=/tmp/old;; esac
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 150 python3 -m benchmarks.profile_step --models sdxl --systems sdfast --out $R/profile-$side > $R/profile-$side.log 2>&1); echo "$side=$?"
done
grep -hE "GPU kernel time|geglu|^\| GEMM|^\| conv|attention" $R/profile-*.log
cd $OUT && tar czf r.tgz r && rm -rf r
