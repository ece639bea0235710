export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
C=$(cat .commit)
XELINK_LAUNCH_CHECK=1 timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -n 8 -m gpu tests/kernels/test_launcher.py tests/kernels/test_norm.py tests/kernels/test_gemm.py > $OUT/kernels_gpu_tests_host.log 2>&1; echo "[exit $?]" >> $OUT/kernels_gpu_tests_host.log; tail -3 $OUT/kernels_gpu_tests_host.log
timeout 100 python3 benchmarks/scripts/kernel_host_profile.py > $OUT/host_profile.txt 2>&1; echo "[profile exit $?]" >> $OUT/host_profile.txt
grep -E "^(torch.matmul|gemm\(|F.rms|rmsnorm\()" $OUT/host_profile.txt
timeout 170 python3 -m xelink.bench gemm --out $OUT/bench --commit $C > $OUT/bench_gemm.log 2>&1; echo "[gemm exit $?]"
timeout 90 python3 -m xelink.bench norm --quick --out $OUT/bench --commit $C > $OUT/bench_norm.log 2>&1; echo "[norm exit $?]"
grep -E "host|row-blocks|vs torch" $OUT/bench_gemm.log | head -30; grep -E "host" $OUT/bench_norm.log | head
