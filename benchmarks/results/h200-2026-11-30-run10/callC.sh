R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>/dev/null
timeout 400 bash benchmarks/gpu_tests.sh $R/tests
cd $R && tar czf $OUT/results.tgz tests
