set -x
R=$OUT/r; mkdir -p $R
timeout 150 python3 -m benchmarks.sweep_geglu_tma --extra --out $R/sweep > $R/sweep.log 2>&1; echo sweep=$?
python3 -c "
import json
for r in json.load(open('$R/sweep/geglu_tma.json')):
  print(r['model'],r['layer'],'cublas',round(r['cublas_us'],1),'gemm',round(r['cublas_gemm_us'],1), ' '.join(str(v.get('us') and round(v['us'],1)) for v in r['configs'].values()))
  [print('   ', k, v['error'][:150]) for k, v in r['configs'].items() if v.get('error')]
"
PYX="import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from kernels.gemm import geglu_projection as gp; from benchmarks.sweep_geglu_tma import extra_configs; gp.TUNING['configs'] = gp.TUNING['configs'] + extra_configs(); from benchmarks.bench_txt2img import main; sys.exit(main(sys.argv[1:]))"
timeout 130 python3 -c "$PYX" --models sdxl,sd15 --systems sdfast --out $R/txt2img-extra > $R/txt2img-extra.log 2>&1; echo extra=$?
grep -hE "/sdfast\] e2e|^\| sdfast" $R/txt2img-extra.log | head -6; grep -h "geglu_projection" $R/txt2img-extra.log | cut -c60-330
cd $OUT && tar czf r.tgz r && rm -rf r
