set -x
R=$OUT/r; mkdir -p $R
timeout 150 python3 probe_gn.py > $R/probe.log 2>&1; echo probe=$?
cat > /tmp/ncu_target.py <<'PY'
import torch
from kernels.norm import group_norm
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(2, 320, 64, 64, device="cuda", generator=g).half().contiguous(memory_format=torch.channels_last)
w = torch.randn(320, device="cuda", generator=g).half(); b = torch.randn(320, device="cuda", generator=g).half()
for _ in range(5):
    group_norm(x, 32, w, b, 1e-5, activation="silu")
torch.cuda.synchronize()
PY
cat $R/probe.log | grep -v Warn | tail -8
M=smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__cycles_active.avg,smsp__cycles_active.max,smsp__cycles_active.min,sm__cycles_active.max,sm__cycles_active.min,gpu__time_duration.sum,smsp__inst_executed.sum
timeout 200 ncu --clock-control none -k regex:gn_cluster -s 6 -c 1 --metrics $M python3 /tmp/ncu_target.py > $R/ncu_stalls.txt 2>&1; echo ncu=$?
grep -E "smsp__|sm__|gpu__" $R/ncu_stalls.txt
cd $OUT && tar czf r.tgz r && rm -rf r
