"""The flash-attention kernel compiles for the GPU without a GPU (ahead-of-time ``triton.compile``
with a ``GPUTarget``): on sm_90 its dots are ``wgmma`` fed by a ``cp.async`` pipeline, its shared
memory fits sm_90's 227 KiB per block, and the configs SD runs do not spill registers (``ptxas -v``
from Triton's bundled CUDA tools). The interpreter tests check the numerics; this checks what the GPU
compiler makes of the same source, so a kernel that only works in the interpreter fails in CI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# In a subprocess without TRITON_INTERPRET (conftest sets it here; @triton.jit then gives interpreter
# functions that cannot be compiled).
_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention import flash_attention as fa

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_(arch, D, dtype, BM, BN, DV, warps, stages, mask=False, upcast=False):
    fn = fa._flash_attn_fwd_kernel
    d0, d1 = fa.head_dim_chunks(D)
    dv0, dv1 = (d0, d1) if DV is None else (DV, 0)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + dtype for n in ("Q", "K", "V", "O")}, KPM="*u8", qk_scale="fp32")
    consts = dict(HEAD_DIM=D, SA=8 if dtype != "fp32" else 4, HAS_MASK=mask, UPCAST=upcast,
                  DOT_PREC="tf32x3" if dtype == "fp32" else "tf32", BLOCK_M=BM, BLOCK_N=BN,
                  D0=d0, D1=d1, DV0=dv0, DV1=dv1, INTERPRET=False,
                  stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)  # unit strides: what the JIT specialises
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("Q", "K", "V", "O", "KPM")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = ck.asm["ptx"]
    spill = None
    if os.path.exists(PTXAS):
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        gpu = "sm_90a" if arch == 90 else f"sm_{arch}"
        r = subprocess.run([PTXAS, "-v", "--gpu-name", gpu, f.name, "-o", os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        found = re.findall(r"(\d+) bytes spill stores", r.stdout + r.stderr)
        spill = max(int(x) for x in found) if found else None
    return dict(shared=ck.metadata.shared, wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync.aligned" in ptx,
                cp_async="cp.async.commit_group" in ptx, spill=spill)


cases = json.loads(sys.argv[1])
print(json.dumps({name: compile_(**kw) for name, kw in cases.items()}))
"""

# name -> (compile kwargs, expect no spills)
CASES = {
    # SD1.5 64x64 self-attention, 8 heads of 40: the hot config family
    "d40_sm90": (dict(arch=90, D=40, dtype="fp16", BM=128, BN=64, DV=None, warps=4, stages=3), True),
    "d40_mask_sm90": (dict(arch=90, D=40, dtype="fp16", BM=128, BN=64, DV=None, warps=4, stages=3, mask=True), True),
    # SDXL / SD2.1 heads of 64, bf16, upcast (split P)
    "d64_bf16_upcast_sm90": (
        dict(arch=90, D=64, dtype="bf16", BM=128, BN=128, DV=None, warps=8, stages=3, upcast=True), True),
    "d80_sm90": (dict(arch=90, D=80, dtype="fp16", BM=128, BN=128, DV=None, warps=8, stages=3), True),
    "d160_sm90": (dict(arch=90, D=160, dtype="fp16", BM=64, BN=64, DV=None, warps=4, stages=3), True),
    # VAE: one head of 512, split output columns, upcast_softmax as the VAE sets it
    "d512_upcast_sm90": (dict(arch=90, D=512, dtype="fp16", BM=128, BN=32, DV=256, warps=8, stages=2, upcast=True), True),
    # fp32 correctness path (3xTF32)
    "d64_fp32_sm90": (dict(arch=90, D=64, dtype="fp32", BM=64, BN=32, DV=None, warps=4, stages=2), False),
    # Ampere: mma.sync
    "d40_sm80": (dict(arch=80, D=40, dtype="fp16", BM=128, BN=64, DV=None, warps=4, stages=3), False),
}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cases = {name: kw for name, (kw, _) in CASES.items()}
    r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"AOT compile failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_compiles(name, compiled):
    info = compiled[name]
    kw, no_spill = CASES[name]
    assert info["shared"] <= 232448, f"{name}: {info['shared']} B of shared memory > 227 KiB"
    assert info["cp_async"], f"{name}: K/V loads are not pipelined through cp.async"
    if kw["arch"] == 90 and kw["dtype"] != "fp32":
        assert info["wgmma"], f"{name}: no wgmma on sm_90"
    if kw["arch"] == 80:
        assert info["mma_sync"], f"{name}: no mma.sync on sm_80"
    if no_spill and info["spill"] is not None:
        assert info["spill"] == 0, f"{name}: {info['spill']} bytes of register spill"
