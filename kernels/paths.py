"""Where sdfast keeps what it builds and measures on a machine: ``$SDFAST_CACHE_DIR``, else ``~/.cache/sdfast``.

``csrc/`` holds the nvcc-built libraries (``kernels.csrc.build``), ``choices/`` the saved kernel choices
(``kernels.select.store``). Read at each call, so a test or a benchmark can point it elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$SDFAST_CACHE_DIR``, else ``~/.cache/sdfast`` (not created here)."""
    return Path(os.environ.get("SDFAST_CACHE_DIR") or Path.home() / ".cache" / "sdfast")
