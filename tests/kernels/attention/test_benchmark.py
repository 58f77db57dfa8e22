"""The attention benchmark module (``benchmarks.ops.attention``) on the CPU: one CLI with the subcommands of the two
scripts it replaced (the kernel suite's attention section and the tile-config sweep), the suite still runs its
``attention`` section from it, and one shape's rows time every backend on that shape's own q, k, v."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_kernels
from benchmarks.ops import attention as bench


def test_cli_subcommands(capsys):
    with pytest.raises(SystemExit):
        bench.main([])  # a subcommand is required
    for cmd, fn in (("bench", bench.bench), ("sweep", bench.sweep)):
        with pytest.raises(SystemExit) as e:
            bench.main([cmd, "--help"])
        assert e.value.code == 0
        assert fn.__name__ == cmd
    with pytest.raises(SystemExit):
        bench.main(["sweep"])  # --out is required
    assert "--out" in capsys.readouterr().err


def test_the_suite_runs_this_module_for_its_attention_section():
    assert bench_kernels.section_module("attention") == "benchmarks.ops.attention"
    assert "attention" in bench_kernels.SECTIONS
    if not torch.cuda.is_available():
        assert bench.run(quick=True) == [{"model": "-", "note": "error: attention benchmark needs CUDA"}]


def test_shapes_and_sweep_configs():
    full, quick = bench.shapes(), bench.shapes(quick=True)
    assert {(s["model"], s["attn"], s["Lq"], s["Lk"], s["D"]) for s in quick} < {
        (s["model"], s["attn"], s["Lq"], s["Lk"], s["D"]) for s in full}
    assert ("vae1024", "self", 16384, 16384, 512) in {(s["model"], s["attn"], s["Lq"], s["Lk"], s["D"]) for s in full}
    labels = [s[0] for s in bench.SWEEP_SHAPES]
    assert len(labels) == len(set(labels)) == 10
    metas = [m for m, _, _ in bench._configs(40, quick=False)]
    assert {(m["D0"], m["D1"]) for m in metas} == {(32, 16), (64, 0)}  # 40 in chunks 32 + 16, or one padded chunk
    assert len(list(bench._configs(64, quick=True))) == 2 * 2 * 3  # 2 tiles x 2 warp counts x 3 stage counts


def test_one_shape_times_every_backend_on_its_own_tensors(monkeypatch, fresh_choices):
    import triton.testing

    from sdfast.passes import attention as ap

    seen = []

    def fake_timer(fn, **kw):  # the GPU timers: run the call once, record what it returned
        seen.append(fn())
        return 0.002  # ms

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_timer)
    monkeypatch.setattr(triton.testing, "do_bench", fake_timer)
    sh = dict(model="t", attn="cross", B=1, H=2, Lq=16, Lk=8, D=16, upcast=False)
    dispatcher = ap.AttentionDispatcher(budget_ms=1.0)
    rows = bench._shape_rows(sh, dispatcher, ["sdpa", "math"], torch.float32, torch.device("cpu"), rep=1)
    assert [r["backend"] for r in rows] == ["sdpa", "math", "dispatcher"]
    assert all(r["us"] == 2.0 and r["x_best"] == 1.0 and r["best"] == "sdpa" and "note" not in r for r in rows)
    assert len(seen) == 2 * len(rows) and all(o.shape == (1, 2, 16, 16) for o in seen)  # (B, H, Lq, D) each time
    q, k, v = bench._inputs(sh, torch.float32, "cpu")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=16 ** -0.5)
    assert all(torch.allclose(o, ref, atol=1e-5) for o in seen)

    # a backend that gives a wrong answer is an error row, and is not the best
    good = dispatcher.backend_fn

    def backend_fn(name):
        fn = good(name)
        return (lambda *a: fn(*a) * 0) if name == "math" else fn

    monkeypatch.setattr(dispatcher, "backend_fn", backend_fn)
    rows = bench._shape_rows(sh, dispatcher, ["sdpa", "math"], torch.float32, torch.device("cpu"), rep=1)
    bad = next(r for r in rows if r["backend"] == "math")
    assert bad["note"].startswith("error: RuntimeError: wrong result") and "us" not in bad
    summary = bench.summary([bench._row({}, **r) for r in rows])
    assert summary == [dict(model="t", attn="cross", Lq=16, Lk=8, H=2, D=16, best="sdpa", picked=rows[0]["picked"],
                            triton_x_best=None, dispatcher_x_best=1.0)]
    assert "| t | cross | 1 | 2 | 16 | 8 | 16 | math |" in bench.report(rows)
