"""Every Triton GEMM kernel of kernels/gemm compiles for sm_80 and sm_90 without a GPU (Triton's
ahead-of-time ``triton.compile`` with a ``GPUTarget``), and its K-loop is software-pipelined through
shared memory with ``cp.async`` (the ``num_stages`` ring) feeding tensor-core MMAs (``mma.sync`` on
sm_80, ``wgmma`` on sm_90). The interpreter tests check the numerics; this checks what the GPU
compiler makes of the same source, so a kernel that only works in the interpreter fails in CI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Run in a subprocess without TRITON_INTERPRET (conftest sets it for this process, and then
# @triton.jit gives interpreter functions that cannot be compiled).
_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.gemm.int8_outlier import _int8_outlier_kernel
from kernels.gemm.w4a16 import _w4a16_kernel
from kernels.gemm.w8a8 import _quantize_per_token_kernel, _w8a8_gemm_kernel


def compile_(fn, types, consts, arch, num_warps, num_stages):
    # pointers and row strides specialised as 16-divisible, as the JIT does for SD's tensors; unit
    # strides passed as constexpr 1, as the JIT specialises them
    sig = dict(types)
    sig.update({k: "constexpr" for k in consts})
    div16 = [k for k, v in types.items() if v.startswith("*") or k.startswith("stride") or k in ("N", "K")]
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = ck.asm["ptx"]
    return dict(shared=ck.metadata.shared,
                cp_async=len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
                commit="cp.async.commit_group" in ptx, wait="cp.async.wait_group" in ptx,
                wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync.aligned" in ptx,
                e4m3_cvt="cvt.rn.satfinite.e4m3x2" in ptx)


W8_T = {"a_ptr": "*i8", "b_ptr": "*i8", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "bias_ptr": "*fp16",
        "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "stride_sn": "i32", "stride_om": "i32"}
FP8_T = {**W8_T, "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv"}
W4_T = {"x_ptr": "*fp16", "qw_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*u8", "smooth_ptr": "*fp32",
        "bias_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
OUT_T = {"xq_ptr": "*i8", "x_ptr": "*fp16", "wq_ptr": "*i8", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
         "mask_ptr": "*i8", "bias_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
         "stride_xm": "i32", "stride_om": "i32"}
Q_T = {"x_ptr": "*fp16", "smooth_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "M": "i32", "stride_xm": "i32", "K": "i32"}
TILE = dict(K_TILES=0, BLOCK_M=128, BLOCK_N=128, GROUP_M=8)
U = dict(stride_xk=1)
CASES = {
    "w8a8_int8": (_w8a8_gemm_kernel, W8_T, dict(HAS_BIAS=True, IS_FP8=False, GROUP_SIZE=0, EVEN_K=True, BLOCK_K=128, **TILE), 8, 3),
    "w8a8_int8_groups": (_w8a8_gemm_kernel, W8_T, dict(HAS_BIAS=False, IS_FP8=False, GROUP_SIZE=128, EVEN_K=False,
                         BLOCK_K=128, **TILE), 8, 3),
    "w8a8_fp8": (_w8a8_gemm_kernel, FP8_T, dict(HAS_BIAS=True, IS_FP8=True, GROUP_SIZE=0, EVEN_K=True, BLOCK_K=128, **TILE), 8, 3),
    "w4a16": (_w4a16_kernel, W4_T, dict(GROUP_SIZE=128, HAS_SMOOTH=True, HAS_BIAS=True, IEEE=False, EVEN_K=True, BLOCK_K=64,
              **U, **TILE), 8, 4),
    "int8_outlier": (_int8_outlier_kernel, OUT_T, dict(HAS_BIAS=True, IEEE=False, BLOCK_K=128, **U, **TILE), 8, 3),
    "quantize_int8": (_quantize_per_token_kernel, Q_T, dict(QMAX=127.0, IS_FP8=False, HAS_SMOOTH=True, K_TILES=0, BLOCK_M=8,
                      BLOCK_K=512, **U), 4, 1),
    "quantize_fp8": (_quantize_per_token_kernel, {**Q_T, "q_ptr": "*fp8e4nv"}, dict(QMAX=448.0, IS_FP8=True, HAS_SMOOTH=True,
                     K_TILES=0, BLOCK_M=8, BLOCK_K=512, **U), 4, 1),
}
out = {}
for name, (fn, types, consts, warps, stages) in CASES.items():
    for arch in (80, 90):
        if ("fp8" in name) and arch < 89:
            continue
        try:
            out[f"{name}@{arch}"] = compile_(fn, types, consts, arch, warps, stages)
        except Exception as e:
            out[f"{name}@{arch}"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
print("RESULT" + json.dumps(out))
"""

BLOCK_K = {"w8a8_int8": 128, "w8a8_int8_groups": 128, "w8a8_fp8": 128,
           "w4a16": 64, "int8_outlier": 128}


@pytest.fixture(scope="module")
def compiled():
    try:
        import triton.backends.compiler  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("triton without ASTSource/GPUTarget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, f"compile script failed (rc={res.returncode}):\n{res.stderr[-4000:]}"
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", list(BLOCK_K))
def test_gemm_kernel_compiles_pipelined(compiled, name, arch):
    if name == "w8a8_fp8" and arch < 89:
        pytest.skip("fp8 tl.dot needs sm_89+ (the launcher raises there)")
    r = compiled[f"{name}@{arch}"]
    assert "error" not in r, f"{name} sm_{arch}: {r.get('error')}"
    assert r["cp_async"] > 0, f"{name} sm_{arch}: K-loop not pipelined (no cp.async)"
    assert r["commit"] and r["wait"]
    assert r["wgmma"] if arch >= 90 else r["mma_sync"], f"{name} sm_{arch}: no tensor-core MMA"
    # the ring holds more than one stage of the A and B tiles
    one_stage = 128 * BLOCK_K[name] * (2 if name == "w4a16" else 1)
    assert r["shared"] >= 2 * one_stage, f"{name} sm_{arch}: only {r['shared']} bytes of shared memory"


@pytest.mark.parametrize("name", ["quantize_int8", "quantize_fp8"])
def test_quantize_kernel_compiles(compiled, name):
    for arch in (80, 90):
        key = f"{name}@{arch}"
        if key not in compiled:
            continue
        assert "error" not in compiled[key], compiled[key].get("error")
    assert compiled[f"{name}@90"]["e4m3_cvt"] == (name == "quantize_fp8")
