#!/usr/bin/env bash
# The one GPU call: GPU tests, kernel benchmarks, the txt2img benchmark and the service benchmark,
# each stage optional; full results under $OUT (tarred, so they come back as few files), a short table last.
#
# On the device machine (see README "GPU runs"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && bash benchmarks/gpu_suite.sh tests kernels txt2img
# Stages: env tests kernels txt2img server presets tasks warmup warmup2 hostwarm trace tune tuneln (default: env tests kernels txt2img server). Extra args:
# PYTEST_ARGS, KERNEL_ARGS, BENCH_ARGS, SERVER_ARGS, PRESET_ARGS, TUNE_ARGS, TRACE_ARGS; per-stage time limits in seconds: T_<stage>
# (default 540). All stages do not fit one 600 s device call. Measured on the H200 (2026-11-29, run 4): tests ~270 s
# (files in parallel; the user-case file alone ~245 s), server ~70 s, kernels: attention ~35 s, sparse ~150 s,
# gemm ~25 s, norm (--quick) ~20 s, quant 43 s; txt2img stock+sdfast with --profile --second-size ~120 s,
# + torch.compile ~150 s; presets: SD1.5 (7 presets) > 290 s, SDXL (4) ~135 s; warmup (cold Triton cache, SD1.5)
# ~75 s; tune ~210 s. Suggested calls:
#   T_tests=300 T_txt2img=170 BENCH_ARGS="--systems stock,sdfast --profile --second-size" bash benchmarks/gpu_suite.sh tests txt2img
#   KERNEL_ARGS="--only attention,sparse,norm" bash benchmarks/gpu_suite.sh kernels warmup
# Quantized / 2:4 presets at model level (issues 7, 8), SD1.5 then SDXL into presets-sd15/ and presets-sdxl/:
#   T_presets=560 PRESET_MODELS=sd15 bash benchmarks/gpu_suite.sh presets   (then PRESET_MODELS=sdxl)
# txt2img, img2img and inpaint on stock, sdfast and torch.compile (issue 31), into tasks-sd15/ and tasks-sdxl/:
#   T_tasks=560 PRESET_MODELS=sd15 bash benchmarks/gpu_suite.sh tasks   (then PRESET_MODELS=sdxl)
set -uo pipefail
OUT=${OUT:-$PWD/out/gpu}
RAW=$OUT/raw
mkdir -p "$RAW"
stages=${*:-env tests kernels txt2img server}
summary=$OUT/summary.md
: > "$summary"
run() { # name, command...  (each stage is cut at ${T_<stage>:-540} seconds, so the call ends in time)
  local name=$1 limit_var="T_$1"; shift
  local t0=$SECONDS
  timeout "${!limit_var:-540}" "$@" > "$RAW/$name.log" 2>&1
  local rc=$?
  echo "| $name | rc=$rc | $((SECONDS - t0)) s |" >> "$summary"
  tail -n 40 "$RAW/$name.log"
  return $rc
}
for stage in $stages; do
  echo "=== $stage"
  case $stage in
    env) run env bash -c 'nvidia-smi; python3 -c "import torch, triton, diffusers, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, diffusers.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
    tests) run tests bash benchmarks/gpu_tests.sh "$RAW" ${PYTEST_ARGS:-} ;;
    kernels) run kernels python3 -m benchmarks.bench_kernels --out "$RAW" ${KERNEL_ARGS:-} ;;
    txt2img) run txt2img python3 -m benchmarks.bench_txt2img --out "$RAW" ${BENCH_ARGS:-} ;;
    server) run server python3 -m benchmarks.bench_server --out "$RAW" ${SERVER_ARGS:-} ;;
    presets) run presets bash benchmarks/presets.sh "$RAW" ;;
    tasks) run tasks bash benchmarks/presets.sh "$RAW" tasks ;;
    warmup) run warmup python3 -m benchmarks.profile_warmup --cold --out "$RAW/warmup" ;;
    warmup2) run warmup2 python3 -m benchmarks.profile_warmup --second-size --out "$RAW/warmup2" ;;
    hostwarm) run hostwarm python3 -m benchmarks.profile_warmup --warm --out "$RAW/hostwarm" ;;
    trace) run trace bash -c "python3 -m benchmarks.trace_e2e --out '$RAW/trace-sd15' \${TRACE_ARGS:-} && python3 -m benchmarks.trace_e2e --model random:sdxl --steps 30 --out '$RAW/trace-sdxl' \${TRACE_ARGS:-}" ;;
    tune) run tune python3 -m benchmarks.ops.group_norm tune --out "$RAW" --budget-s "${T_tune_budget:-200}" ${TUNE_ARGS:-} ;;
    tuneln) run tuneln python3 -m benchmarks.ops.layer_norm tune --out "$RAW" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$RAW" .
echo
echo "=== summary (stage | exit | seconds)"
cat "$summary"
for f in "$RAW"/txt2img.md "$RAW"/kernels.md "$RAW"/presets-*/txt2img.md "$RAW"/tasks-*/txt2img.md "$RAW"/warmup/warmup.txt "$RAW"/warmup2/warmup.txt "$RAW"/hostwarm/warmup.txt "$RAW"/trace-*/trace_e2e.txt; do [ -f "$f" ] && { echo "--- $(basename "$f")"; cat "$f"; }; done
exit 0
