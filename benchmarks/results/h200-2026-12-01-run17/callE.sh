R=$OUT/r; mkdir -p $R
timeout 200 python3 -m benchmarks.sweep_geglu_tma --ws --out $R/geglu > $R/geglu.log 2>&1
timeout 240 python3 -m benchmarks.sweep_attention --quick --ws --only "sdxl self 32x32,sdxl self 64x64,sd15 self 32x32,sd15 self 64x64" --out $R/attn > $R/attn.log 2>&1
grep -v "Warning\|warn" $R/geglu.log | tail -25
grep -v "Warning\|warn" $R/attn.log | tail -30
python3 - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/r/attn/sweep_attention.json"))
for shape in sorted({r["shape"] for r in rows}):
    rs = [r for r in rows if r["shape"] == shape and "us" in r]
    for ws in (False, True):
        sub = sorted((r for r in rs if r["config"].endswith(" ws") == ws and not r["config"].startswith("sdpa")), key=lambda r: r["us"])
        print(shape, "ws" if ws else "no-ws", [(r["config"], r["us"]) for r in sub[:3]])
    print(shape, "errors", [(r["config"], r["error"][:80]) for r in rows if r["shape"] == shape and "error" in r][:3])
PY
cd $OUT && tar czf r.tgz r && rm -rf r
