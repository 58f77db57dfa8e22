"""Run 17, call C: the rule-ranked cluster GroupNorm plans against every plan (channels_last and NCHW) at SD's
shapes, with the default knobs."""

from benchmarks.bench_group_norm_cluster import _sweep

SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 32, 32), (2, 1280, 16, 16), (2, 640, 64, 64),
          (2, 1280, 8, 8), (2, 960, 32, 32), (2, 1920, 32, 32), (2, 2560, 16, 16)]
for shape in SHAPES:
    for nchw in (False, True):
        rows = [r for r in _sweep(shape, nchw) if "us" in r]
        one = sorted((r for r in rows if r["one_wave"]), key=lambda r: r["us"])
        planned = [r for r in rows if r["planned"]]
        if not one:
            print(f"== {shape} {'NCHW' if nchw else 'NHWC'}: no one-wave plan of {len(rows)}")
            continue
        p = planned[0] if planned else None
        print(f"== {shape} {'NCHW' if nchw else 'NHWC'}: best {one[0]['us']:.2f} us "
              + " ".join(f"{k}={one[0].get(k)}" for k in ("CS", "K", "J", "nt"))
              + (f" | planned {p['us']:.2f} us ({p['us'] / one[0]['us']:.2f}x) " + " ".join(f"{k}={p.get(k)}" for k in ("CS", "K", "J", "nt")) if p else " | planned: none"))
