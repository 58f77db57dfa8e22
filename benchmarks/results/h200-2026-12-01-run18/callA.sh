#!/bin/bash
# Run 18, call A: Nsight Compute on SD1.5's biggest kernels (what limits them), the attention sweep with the
# conditional rescaling, GPU attention tests, and the txt2img + step profile at the current commit.
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv > $R/gpu.txt 2>&1
git log --oneline -1 > $R/commit.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/commit.txt
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" > $R/ncu.log
for t in attn_cudnn attn_triton attn_triton_lazy gemm_l0 geglu_l0 conv_l0; do
  case $t in attn_cudnn) K='regex:sdpa|fmha|flash|cudnn';; attn_triton*) K='regex:_flash_attn_fwd';; gemm_l0) K='regex:nvjet|gemm|sm90';;
    geglu_l0) K='regex:_geglu_tma';; conv_l0) K='regex:fprop|conv|xmma';; esac
  timeout 100 $NCU --clock-control none -k "$K" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed_pipe_xu.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
    --print-details all python3 probe_ncu.py $t > $R/ncu-$t.txt 2>&1
  echo "$t rc=$?" >> $R/ncu.log
done
timeout 250 python3 -m benchmarks.sweep_attention --quick --lazy --only "sd15 self 64x64,sdxl self,sd15 self 32x32" --out $R/attn > $R/attn.log 2>&1
echo "sweep rc=$?" >> $R/ncu.log
cd $OUT && tar czf r.tgz r && rm -rf r
