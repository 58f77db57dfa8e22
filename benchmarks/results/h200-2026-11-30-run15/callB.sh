set -x
R=$OUT/r; mkdir -p $R
timeout 170 python3 -m benchmarks.sweep_geglu_tma --out $R/sweep > $R/sweep.log 2>&1; echo sweep=$?
grep -E "^\| s" $R/sweep.log | tail -6
python3 -c "
import json
for r in json.load(open('$R/sweep/geglu_tma.json')):
  print(r['model'],r['layer'],'cublas',round(r['cublas_us'],1),'gemm',round(r['cublas_gemm_us'],1), ' '.join(str(v.get('us') and round(v['us'],1)) for v in r['configs'].values()))
"
PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1 PYTORCH_TUNABLEOP_FILENAME=/tmp/tunableop.csv timeout 160 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img-tunableop > $R/txt2img-tunableop.log 2>&1; echo tunable=$?
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img-tunableop.log | head -6; cp /tmp/tunableop*.csv $R/ 2>/dev/null; wc -l /tmp/tunableop*.csv
timeout 100 python3 -m benchmarks.profile_step --models sdxl --systems sdfast --out $R/profile > $R/profile.log 2>&1; echo profile=$?
tail -25 $R/profile.log
cd $OUT && tar czf r.tgz r && rm -rf r
