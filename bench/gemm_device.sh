#!/bin/bash
# bench/gemm_device.sh: one full GPU-machine pass for the grouped GEMM: build, check spills and
# SASS, run the GEMM tests, a compute-sanitizer memcheck on a small case, and bench/gemm.py
# (through build/libmok_bench.so). Logs go to $OUT (the device tool's output folder) or
# /tmp/mok_out. Extra bench arguments come from $BENCH_ARGS. Run from the repository root:
#   bash bench/gemm_device.sh
set -u
OUT=${OUT:-/tmp/mok_out}
mkdir -p "$OUT" build
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv \
  > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

GG=src/cuda/gemm/grouped_gemm.cu
GG_OBJ=build/src/cuda/gemm/grouped_gemm.o
GG_LOG=build/ptxas/src_cuda_gemm_grouped_gemm.cu.log  # the Makefile's name for $GG's ptxas log
BENCH_LIB=1
if ! timeout 300 make -j16 build/libmok.so build/libmok_bench.so build/mok_tests \
    > "$OUT/build.log" 2>&1; then
  # Another part of the tree may be mid-change: the GEMM and its tests alone. The benchmark needs
  # build/libmok_bench.so, which links every object (the driver reaches the transport and the
  # layer's tuning too), so it is skipped then.
  echo "make failed (see build.log); building the GEMMs and their tests alone" | tee -a "$OUT/build.log"
  BENCH_LIB=0
  NV="nvcc -std=c++17 -O3 -g -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Iinclude -Isrc -DMOK_WITH_CUDA --expt-relaxed-constexpr"
  mkdir -p build/src/cuda/gemm build/tests/gpu build/ptxas
  OBJS="build/tests/runner.o"
  ok=1
  for f in $GG src/cuda/gemm/grouped_wgrad.cu; do  # ptxas logs named as the Makefile names them
    o=build/${f%.cu}.o; log=build/ptxas/$(echo $f | tr / _).log
    $NV -Xptxas -v -c $f -o $o 2> $log || { cat $log >> "$OUT/build.log"; ok=0; }
    OBJS="$OBJS $o"
  done
  for t in test_gemm test_gemm_fp8 test_gemm_wgrad; do
    $NV -c tests/gpu/$t.cu -o build/tests/gpu/$t.o >> "$OUT/build.log" 2>&1 || ok=0
    OBJS="$OBJS build/tests/gpu/$t.o"
  done
  [ $ok = 1 ] && gcc -std=c11 -O2 -c tests/runner.c -o build/tests/runner.o >> "$OUT/build.log" 2>&1 &&
  gcc -o build/mok_tests $OBJS -L/usr/local/cuda/lib64 -lcudart -lcublas -lstdc++ -lm \
    >> "$OUT/build.log" 2>&1 ||
    { echo "GEMM build failed"; tail -30 "$OUT/build.log"; exit 1; }
fi
grep -A2 "gg_bf16_kernel" $GG_LOG | grep -E "registers|spill" | sort | uniq -c
echo "HGMMA in grouped_gemm.o: $(cuobjdump -sass $GG_OBJ | grep -c HGMMA)"
cuobjdump -sass $GG_OBJ > "$OUT/grouped_gemm.sass" 2>&1

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

if [ "$BENCH_LIB" != 1 ]; then
  echo "bench skipped: build/libmok_bench.so was not built (see build.log)"; exit 1
fi
timeout 380 python3 bench/gemm.py --jsonl "$OUT/gemm.jsonl" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "/fp8|Error|error" "$OUT/bench.log" | head -16; tail -31 "$OUT/bench.log"
