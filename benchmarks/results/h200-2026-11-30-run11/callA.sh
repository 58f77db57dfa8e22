R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $R/gpu.txt
git log -1 --format=%h >> $R/gpu.txt 2>/dev/null
timeout 100 python3 callA_gn.py > $R/gn_breakdown.txt 2>&1; tail -5 $R/gn_breakdown.txt
for m in sd15 sdxl; do
  timeout 170 python3 -m benchmarks.profile_warmup --model random:$m --cold --second-size --out $R/ss-$m > $R/ss-$m.out 2>&1
  rm -f $R/ss-$m/warmup.pstats; head -12 $R/ss-$m/warmup.txt; grep -A30 "compiled in the profiled" $R/ss-$m/warmup.txt | head -30
done
