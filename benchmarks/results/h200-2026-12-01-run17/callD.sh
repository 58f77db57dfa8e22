R=$OUT/r; mkdir -p $R
python3 probe_gn_phases.py > $R/probe.log 2>&1
grep -v "warning\|^\s*$\|\^\|__attribute__\|static constexpr\|Remark" $R/probe.log | tail -30
cd $OUT && tar czf r.tgz r && rm -rf r
