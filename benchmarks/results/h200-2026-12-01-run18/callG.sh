#!/bin/bash
# Run 18, call G (eb1ecab): the GEGLU TMA GEMM with one program per tile (sweep --per-tile).
R=$OUT/r; mkdir -p $R
timeout 200 python3 -m benchmarks.sweep_geglu_tma --per-tile --out $R/geglu > $R/geglu.log 2>&1; echo geglu=$?
python3 - $R/geglu/geglu_tma.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"] if isinstance(d, dict) else d:
    ok = sorted(((v["us"], c) for c, v in r["configs"].items() if v.get("us")), key=lambda t: t[0])
    print(r["model"], r["layer"], "cuBLAS+GEGLU", round(r["cublas_us"], 1), "GEMM", round(r["cublas_gemm_us"], 1))
    for us, c in ok[:4]:
        print("   ", round(us, 1), c.replace("TileConfig", ""))
PY
cd $OUT && tar czf r.tgz r && rm -rf r
