#!/usr/bin/env bash
# The GPU tests (marker gpu), one pytest process per test file, files in parallel: a CUDA fault (which
# breaks the whole CUDA context of its process) stays in its own file. The big kernel files are spread
# over pytest-xdist workers where xdist is installed. Per file: tests-<file>.log and junit-<file>.xml in
# the output folder; a pass/fail table per file last.
# Usage: bash benchmarks/gpu_tests.sh OUT_DIR [pytest args...]   (GPU_TEST_JOBS files at once, default 7;
# GPU_TEST_FILES: a regex of the test files to run, default all)
set -uo pipefail
out=${1:-out/gpu}; shift || true
mkdir -p "$out"
files=$(grep -rl --include='test_*.py' '^pytestmark = pytest.mark.gpu' tests | sort | grep -E "${GPU_TEST_FILES:-.}")
xdist=""
python3 -c "import xdist" 2>/dev/null && xdist="-n 3"
run_file() {
  local f=$1; shift
  local name; name=$(basename "$f" .py)
  local par=""
  case $name in test_gemm_gpu|test_group_norm_gpu|test_sparse24_gpu|test_attention_gpu) par=$xdist ;; esac
  python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider $par --junitxml "$out/junit-$name.xml" "$@" "$f" \
    > "$out/tests-$name.log" 2>&1
  echo "$name exit=$? $(tail -n 1 "$out/tests-$name.log")"
}
export -f run_file
export out xdist
printf '%s\n' $files | xargs -P "${GPU_TEST_JOBS:-7}" -I{} bash -c 'run_file "$@"' _ {} "$@"
python3 - "$out" <<'PY'
import glob, os, sys, xml.etree.ElementTree as ET
rows, total = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "junit-*.xml"))):
    c = dict.fromkeys(total, 0)
    for tc in ET.parse(path).iter("testcase"):
        kind = next((k for k in ("failure", "error", "skipped") if tc.find(k) is not None), "passed")
        c[{"failure": "failed"}.get(kind, kind)] += 1
    rows.append((os.path.basename(path)[6:-4], c))
    for k in total:
        total[k] += c[k]
print("| GPU test file | passed | failed | error | skipped |\n| --- | --- | --- | --- | --- |")
for name, c in rows + [("total", total)]:
    print(f"| {name} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |")
PY
