set -x
R=$OUT/r; mkdir -p $R
timeout 170 python3 -m benchmarks.sweep_geglu_tma --out $R/sweep > $R/sweep.log 2>&1; echo sweep=$?
grep -E "^\| s|Error" $R/sweep.log | tail -8
python3 -c "
import json
for r in json.load(open('$R/sweep/geglu_tma.json')):
  print(r['model'],r['layer'],'cublas',round(r['cublas_us'],1),'gemm',round(r['cublas_gemm_us'],1), ' '.join(str(v.get('us') and round(v['us'],1)) for v in r['configs'].values()))
  [print('   ', k, v['error'][:150]) for k, v in r['configs'].items() if v.get('error')]
"
timeout 140 python3 -m benchmarks.bench_txt2img --models sd15,sdxl --systems sdfast --out $R/txt2img > $R/txt2img.log 2>&1; echo on=$?
grep -hE "/sdfast\] e2e|^\| sdfast|first image" $R/txt2img.log | head -6
cd $OUT && tar czf r.tgz r && rm -rf r
