"""Compile every CUDA source under kernels/ (csrc/ and the op folders) with nvcc to an object file, for sm_80 and sm_90.

Needs nvcc, no GPU: a syntax, template or inline-PTX error (ptxas assembles the PTX for each real
architecture) fails here, in CI, instead of on the GPU machine.

    python kernels/csrc/check_compile.py [--arch 8.0 --arch 9.0] [--nvcc PATH]

Exit status 0 when every source compiles for every architecture, 1 on a compile error, 2 when nvcc
is missing. The .cu files are pure CUDA (torch is only seen by gemm_binding.cpp), so no torch
headers are needed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_ARCHS = ("8.0", "9.0")


def _find_nvcc() -> str | None:
    import os
    import shutil

    p = shutil.which("nvcc")
    if p:
        return p
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


def compile_sources(archs=DEFAULT_ARCHS, nvcc: str | None = None, sources=None) -> list[tuple[str, str, int, str]]:
    """Compile each source for each arch with ``nvcc -c``; returns (source, arch, returncode, stderr) rows.

    Raises FileNotFoundError when nvcc is not found.
    """
    nvcc = nvcc or _find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    sources = sorted(HERE.parent.rglob("*.cu")) if sources is None else [Path(s) for s in sources]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            for arch in archs:
                num = arch.replace(".", "")
                obj = Path(tmp) / f"{src.stem}_sm{num}.o"
                cmd = [nvcc, "-c", str(src), "-o", str(obj), "-O3", "-std=c++17",
                       f"-gencode=arch=compute_{num},code=sm_{num}", "-Werror", "all-warnings"]
                res = subprocess.run(cmd, capture_output=True, text=True)
                rows.append((src.name, arch, res.returncode, res.stderr))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="compute capability, e.g. 8.0 (repeatable; default 8.0 and 9.0)")
    ap.add_argument("--nvcc", default=None)
    args = ap.parse_args(argv)
    try:
        rows = compile_sources(tuple(args.arch or DEFAULT_ARCHS), args.nvcc)
    except FileNotFoundError as e:
        print(f"check_compile: {e}", file=sys.stderr)
        return 2
    ok = True
    for src, arch, rc, err in rows:
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {src} sm_{arch.replace('.', '')}")
        if rc != 0:
            ok = False
            print(err, file=sys.stderr)
    if not rows:
        print("check_compile: no .cu sources found", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
