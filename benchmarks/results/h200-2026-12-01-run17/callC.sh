R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
GPU_TEST_FILES='group_norm|test_norm_gpu|test_engine_gpu' bash benchmarks/gpu_tests.sh $R/tests > $R/tests.txt 2>&1
python3 probe_gn_planned.py > $R/probe.log 2>&1
python3 -c "import logging,sys; logging.basicConfig(level=logging.WARNING); logging.getLogger('sdfast.kernels').setLevel(logging.INFO); from benchmarks.bench_txt2img import main; sys.exit(main(['--models','sd15,sdxl','--systems','sdfast','--out','$R/txt2img']))" > $R/txt2img.log 2>&1
python3 -m benchmarks.profile_step --models sd15 --systems sdfast --out $R/profile > $R/profile.log 2>&1
grep "==" $R/probe.log
grep -i "group_norm" $R/txt2img.log | head -40
tail -12 $R/txt2img.log
grep -i "GroupNorm\|gn_\|total" $R/profile.log | head
cat $R/tests.txt
cd $OUT && tar czf r.tgz r && rm -rf r
