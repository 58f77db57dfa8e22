set -x
R=$OUT/r; mkdir -p $R
timeout 150 python3 probe_gn.py > $R/probe.log 2>&1; echo probe=$?
cat $R/probe.log | grep -v Warn | tail -12
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
timeout 200 ncu --clock-control none -k regex:gn_cluster -s 6 -c 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 /tmp/ncu_target.py > $R/ncu.txt 2>&1; echo ncu=$?
grep -E "Duration|Throughput|Elapsed Cycles|Registers|Achieved|Theoretical Occ|Cluster|Stall|Warp Cycles|Block Size|Grid Size|Waves|Active|Eligible|Issued|Hit Rate|L2|DRAM|One or More|No Eligible" $R/ncu.txt | head -70
cd $OUT && tar czf r.tgz r && rm -rf r
