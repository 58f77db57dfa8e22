"""kernels/csrc: the CUDA C++ cp.async W4A16 GEMM and the cluster GroupNorm compile with nvcc for sm_80 and sm_90 (no GPU needed),
a PTX error is caught by the check, and the build helpers do nothing at import. Skipped without
nvcc (CI's machine has nvcc 13.0)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.csrc import build, check_compile

NVCC = build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
CSRC = Path(build.__file__).parent


@needs_nvcc
def test_cu_compiles_for_sm80_and_sm90():
    rows = check_compile.compile_sources(("8.0", "9.0"))
    assert [(r[0], r[1]) for r in rows] == [(src, arch) for src in ("gemm_cp_async.cu", "cluster.cu")
                                            for arch in ("8.0", "9.0")]
    for src, arch, rc, err in rows:
        assert rc == 0, f"{src} sm_{arch}: {err}"


def test_check_compile_script_exit_status():
    """The script's report and exit status; ``--nvcc`` stands in a compiler that always succeeds or always fails
    (the real compiles are test_cu_compiles_for_sm80_and_sm90's, through the same ``compile_sources``)."""
    script = [sys.executable, str(CSRC / "check_compile.py"), "--arch", "8.0", "--nvcc"]
    res = subprocess.run([*script, shutil.which("true")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "ok   gemm_cp_async.cu sm_80" in res.stdout and "ok   cluster.cu sm_80" in res.stdout
    res = subprocess.run([*script, shutil.which("false")], capture_output=True, text=True)
    assert res.returncode == 1 and "FAIL gemm_cp_async.cu sm_80" in res.stdout


@needs_nvcc
def test_check_catches_a_ptx_error(tmp_path):
    src = (CSRC / "gemm_cp_async.cu").read_text()
    bad = src.replace("cp.async.cg.shared.global [%0], [%1], 16, %2;", "cp.async.cg.shared.global [%0], [%1], 8, %2;")
    assert bad != src  # .cg only allows 16-byte copies: ptxas must reject 8
    (tmp_path / "bad.cu").write_text(bad)
    rows = check_compile.compile_sources(("8.0",), sources=[tmp_path / "bad.cu"])
    assert rows[0][2] != 0 and "cp.async" in rows[0][3]


def test_kernel_source_uses_the_required_ptx():
    src = (CSRC / "gemm_cp_async.cu").read_text()
    for needle in ("cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group",
                   "mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", 'extern "C"'):
        assert needle in src
    assert "#include <torch" not in src and "#include <ATen" not in src  # pure CUDA


@needs_nvcc
def test_ctypes_library_builds_and_exports_launchers(tmp_path, monkeypatch):
    monkeypatch.setenv("SDFAST_CACHE_DIR", str(tmp_path))
    build.load_ctypes_library.cache_clear()
    try:
        lib = build.load_ctypes_library(("8.0",))
        assert lib.sdfast_gemm_w4a16.restype is not None and not hasattr(lib, "sdfast_gemm_f16")
        assert list((tmp_path / "csrc").glob("libsdfast_gemm_*.so"))
    finally:
        build.load_ctypes_library.cache_clear()


def test_import_builds_nothing():
    code = ("import subprocess, kernels.csrc.build as b, kernels.gemm.w4a16; "
            "assert b.load_extension.cache_info().currsize == 0; "
            "assert b.load_ctypes_library.cache_info().currsize == 0; assert not b._backend_choice; print('clean')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=CSRC.parent.parent)
    assert res.returncode == 0 and "clean" in res.stdout, res.stderr


def test_gencode_flags():
    assert build.gencode_flags(["8.0", "9.0"]) == ["-gencode=arch=compute_80,code=sm_80",
                                                   "-gencode=arch=compute_90,code=sm_90"]
    with pytest.raises(ValueError, match="sm_80"):
        build.gencode_flags(["7.5"])


def test_wrappers_reject_cpu_and_bad_shapes():
    a = torch.randn(8, 64).half()
    with pytest.raises(NotImplementedError, match="CUDA"):
        build.gemm_w4a16(a, torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 1).half(), torch.zeros(8, 1, dtype=torch.uint8))
