#!/bin/bash
# bench/gemm_device.sh: one full GPU-machine pass for the grouped GEMM: build, check spills and
# SASS, run the GEMM tests, a compute-sanitizer memcheck on a small case, and bench/gemm.py.
# Logs go to $OUT (the device tool's output folder) or /tmp/mok_out. Extra bench arguments come
# from $BENCH_ARGS. Run from the repository root:  bash bench/gemm_device.sh
set -u
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT" build
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if ! timeout 300 make -j16 build/libmok.so build/mok_tests > "$OUT/build.log" 2>&1; then
  echo "make failed (see build.log); building the GEMM library and tests alone" | tee -a "$OUT/build.log"
  NV="nvcc -std=c++17 -O3 -g -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Iinclude -Isrc -DMOK_WITH_CUDA"
  mkdir -p build/src/cuda build/tests/gpu build/ptxas
  $NV -Xptxas -v -c src/cuda/gemm/grouped_gemm.cu -o build/src/cuda/grouped_gemm.o \
    2> build/ptxas/src_cuda_grouped_gemm.cu.log &&
  $NV -c tests/gpu/test_gemm.cu -o build/tests/gpu/test_gemm.o &&
  gcc -std=c11 -O2 -c tests/runner.c -o build/tests/runner.o &&
  gcc -shared -o build/libmok.so build/src/cuda/grouped_gemm.o -L/usr/local/cuda/lib64 -lcudart -lstdc++ &&
  gcc -o build/mok_tests build/tests/runner.o build/tests/gpu/test_gemm.o build/src/cuda/grouped_gemm.o \
    -L/usr/local/cuda/lib64 -lcudart -lcublas -lstdc++ -lm >> "$OUT/build.log" 2>&1 ||
    { echo "GEMM build failed"; tail -30 "$OUT/build.log"; exit 1; }
fi
grep -A2 "gg_bf16_kernel" build/ptxas/src_cuda_grouped_gemm.cu.log | grep -E "registers|spill" | sort | uniq -c
echo "HGMMA in grouped_gemm.o: $(cuobjdump -sass build/src/cuda/grouped_gemm.o | grep -c HGMMA)"
cuobjdump -sass build/src/cuda/grouped_gemm.o > "$OUT/grouped_gemm.sass" 2>&1

timeout 300 ./build/mok_tests gemm > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -vE "^PASS" "$OUT/tests.log" | head -40

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  timeout 120 compute-sanitizer --tool memcheck ./build/mok_tests gemm_bf16_store_bf16_matches_cpu \
    > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.log"
  timeout 120 compute-sanitizer --tool memcheck ./build/mok_tests gemm_fp8_block \
    >> "$OUT/memcheck.log" 2>&1
  echo "memcheck fp8 rc=$?"; tail -3 "$OUT/memcheck.log"
fi

timeout 380 python3 bench/gemm.py --jsonl "$OUT/gemm.jsonl" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "/fp8|Error|error" "$OUT/bench.log" | head -16; tail -31 "$OUT/bench.log"
