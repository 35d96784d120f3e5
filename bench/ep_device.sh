#!/bin/bash
# bench/ep_device.sh: one full pass of expert parallelism on a 2-GPU machine (issue 30): build
# against the NCCL that PyTorch loads, then the transport tests, the EP tests (ep_two_gpus_equal_one
# across the two GPUs, and the virtual-rank tests), the binding's EP tests, and bench/ep.py on two
# real ranks under torchrun (EP = 2 against EP = 1 of the same per-rank problem).
# Logs go to $OUT (the device tool's output folder) or /tmp/mok_out; BENCH_ARGS are passed on to
# bench/ep.py. Run from the repository root:  bash bench/ep_device.sh
set -u
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

# One libnccl.so.2 per process, PyTorch's (bench/transport_device.sh says why).
NH=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)
if [ -n "$NH" ] && [ -f "$NH/include/nccl_device.h" ]; then export NCCL_HOME="$NH"; fi
rm -rf build
if ! timeout 400 make -j16 all > "$OUT/build.log" 2>&1; then
  echo "build failed:"; grep -E " error" "$OUT/build.log" | head -20; exit 1
fi

timeout 300 ./build/mok_tests transport > "$OUT/transport_tests.log" 2>&1
echo "transport tests rc=$?"; tail -3 "$OUT/transport_tests.log"
timeout 300 ./build/mok_tests test_ep > "$OUT/ep_tests.log" 2>&1
echo "EP tests rc=$?"; grep -E "FAIL|SKIP|passed" "$OUT/ep_tests.log"
timeout 300 python3 -m pytest -q -rs tests/python/test_ep_binding.py > "$OUT/ep_binding.log" 2>&1
echo "binding EP tests rc=$?"; tail -3 "$OUT/ep_binding.log"

timeout 500 torchrun --nproc-per-node=2 bench/ep.py --jsonl "$OUT/ep.jsonl" ${BENCH_ARGS:-} \
  > "$OUT/ep_bench.log" 2>&1
echo "bench rc=$?"; tail -20 "$OUT/ep_bench.log"
