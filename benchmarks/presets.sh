#!/usr/bin/env bash
# Quantized and 2:4 presets at model level (issues 7, 8): bench_txt2img per model into OUT_DIR/presets-<model>/
# (rows are written as they finish, so a time limit keeps what was measured). PRESET_MODELS (default "sd15 sdxl"),
# PRESET_SYSTEMS (a comma list for every model instead of the defaults below), PRESET_ARGS (extra
# bench_txt2img arguments). Usage: bash benchmarks/presets.sh OUT_DIR
# Tasks (issue 31): `bash benchmarks/presets.sh OUT_DIR tasks` runs txt2img, img2img (strength 0.6) and inpaint
# (strength 1.0) on the same loaded stock, sdfast and torch.compile systems (compile last: the slowest, cut first by
# a time limit), 30 steps, per model into OUT_DIR/tasks-<model>/; the same PRESET_* variables apply.
# Speed tiers (issue 34): `bash benchmarks/presets.sh OUT_DIR deepcache` runs bench_txt2img's deepcache-sd15 (512²,
# 50 steps) and deepcache-sdxl (1024², 30 steps) presets: sdfast exact and cache_interval 2, 3, 5 at cache_branch 0
# and 2, with PSNR / SSIM against the exact image (SSIM needs torchmetrics: ship it with ../shared/tools/gpu-wheels.sh
# torchmetrics==1.9.0 lightning_utilities==0.15.3); `... fewstep` the few-step presets turbo-sdxl-512, lcm-sdxl-1024
# and lcm-sd15-512 (stock and sdfast, 10 repeats, with the e2e breakdown), each into OUT_DIR/<preset>/; PRESET_ARGS
# applies.
set -uo pipefail
out=${1:-out/gpu}
mode=${2:-presets}
if [ "$mode" = deepcache ] || [ "$mode" = fewstep ]; then
  if [ "$mode" = deepcache ]; then names="deepcache-sd15 deepcache-sdxl"; else names="turbo-sdxl-512 lcm-sdxl-1024 lcm-sd15-512"; fi
  for preset in $names; do
    python3 -m benchmarks.bench_txt2img --preset "$preset" --out "$out/$preset" ${PRESET_ARGS:-}
  done
  exit 0
fi
if [ "$mode" = tasks ]; then
  for model in ${PRESET_MODELS:-sd15 sdxl}; do
    python3 -m benchmarks.bench_txt2img --models "$model" --steps 30 --repeats 2 --no-fp32-ref \
      --systems "${PRESET_SYSTEMS:-stock,sdfast,compile}" --task txt2img,img2img,inpaint --out "$out/tasks-$model" \
      ${PRESET_ARGS:-}
  done
  exit 0
fi
declare -A systems=(
  [sd15]=sdfast,sdfast-fp8-static,sdfast-w8a8,sdfast-fp8,sdfast-sparsegpt,sdfast-sparse24,sdfast-w4a16,sdfast-w4a16-gptq,sdfast-int8-outlier
  [sdxl]=sdfast,sdfast-fp8-static,sdfast-fp8,sdfast-w8a8,sdfast-sparsegpt,sdfast-sparse24
)
for model in ${PRESET_MODELS:-sd15 sdxl}; do
  python3 -m benchmarks.bench_txt2img --models "$model" --steps 30 --repeats 2 --no-fp32-ref \
    --systems "${PRESET_SYSTEMS:-${systems[$model]}}" --out "$out/presets-$model" ${PRESET_ARGS:-}
done
