# MoK build. `make` builds build/libmok.so (host C always; CUDA objects for sm_90a when nvcc is
# found), `make test` runs every test and ends with "N passed, N failed, N skipped", `make run`
# runs the main job (GPU when present, else the CPU reference on a small shape), `make bench`
# runs the benchmarks (needs an H200 and torch).

CC       ?= gcc
CXX      ?= g++
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(realpath $(NVCC))),)
BUILD    := build

# No -fvisibility=hidden here: it would hide mok.h's functions too, and then the version script
# (src/api/exports.map, local: *) exports nothing. The script alone keeps everything else local.
CFLAGS   := -std=c11 -O2 -g -Wall -Wextra -Werror=implicit-function-declaration -fPIC \
            -Iinclude -Isrc
LDLIBS   := -lm -lpthread

HOST_SRCS := $(wildcard src/api/*.c src/cpu/*.c src/gpu/*.c)
CUDA_SRCS :=
TEST_SRCS := $(wildcard tests/*.c)
GPU_TEST_SRCS :=

ifneq ($(NVCC),)
  CUDA_SRCS     := $(wildcard src/cuda/*/*.cu)
  GPU_TEST_SRCS := $(wildcard tests/gpu/*.cu)
  CFLAGS        += -DMOK_WITH_CUDA -I$(CUDA_HOME)/include
  NVCCFLAGS     := -std=c++17 -O3 -g -lineinfo -gencode=arch=compute_90a,code=sm_90a \
                   -Xcompiler -fPIC -Xptxas -v -Iinclude -Isrc -DMOK_WITH_CUDA \
                   --expt-relaxed-constexpr
  # No -lcuda: CI machines have no driver; driver entry points come from cudaGetDriverEntryPoint.
  CUDA_LIBS     := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart
  LDLIBS        += $(CUDA_LIBS) -lstdc++
  # NCCL 2.28+ with the device API headers, for expert parallelism: NCCL_HOME when given, else
  # the CUDA toolkit's, else the nvidia-nccl Python wheel (PyTorch's). Without it the NCCL
  # constructors report MOK_ERROR_NOT_AVAILABLE. Only the headers are used at build time:
  # libmok.so never links libnccl (an application loading MoK first must still get its own NCCL,
  # e.g. PyTorch's); src/gpu/nccl_loader.c dlopens libnccl.so.2 on first use, the one already in
  # the process if any, else the loader's search, else NCCL_LIBDIR's. mok_tests links it, as an
  # application owning NCCL communicators does. The wheel ships only libnccl.so.2.
  ifeq ($(NCCL_HOME),)
    NCCL_HOME := $(shell if [ -f "$(CUDA_HOME)/include/nccl_device.h" ]; then echo "$(CUDA_HOME)"; \
                   else python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null; fi)
  endif
  ifneq ($(wildcard $(NCCL_HOME)/include/nccl_device.h),)
    NCCL_LIBDIR := $(firstword $(foreach d,lib lib64,$(if $(wildcard $(NCCL_HOME)/$(d)/libnccl.so.2),$(NCCL_HOME)/$(d))))
    # before the toolkit's include dir, which may hold another nccl.h
    CFLAGS      := -DMOK_WITH_NCCL -I$(NCCL_HOME)/include $(CFLAGS)
    NVCCFLAGS   := -DMOK_WITH_NCCL -I$(NCCL_HOME)/include $(NVCCFLAGS)
    LDLIBS      += -ldl
    ifneq ($(NCCL_LIBDIR),)
      CFLAGS         += -DMOK_NCCL_LIBDIR='"$(NCCL_LIBDIR)"'
      NCCL_TEST_LIBS := -L$(NCCL_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR) -l:libnccl.so.2
    endif
  endif
endif

HOST_OBJS := $(HOST_SRCS:%.c=$(BUILD)/%.o)
CUDA_OBJS := $(CUDA_SRCS:%.cu=$(BUILD)/%.o)
TEST_OBJS := $(TEST_SRCS:%.c=$(BUILD)/%.o) $(GPU_TEST_SRCS:%.cu=$(BUILD)/%.o)
HEADERS   := $(wildcard include/*.h src/*/*.h bench/driver/*.h src/cuda/*.cuh src/cuda/*/*.h src/cuda/*/*.cuh \
               tests/*.h tests/support/*.h tests/gpu/*.h tests/gpu/*.cuh)

.PHONY: all test run bench fuzz clean check-spills nccl-info sanitize
all: $(BUILD)/libmok.so $(BUILD)/libmok.a $(BUILD)/libmok_bench.so $(BUILD)/mok_tests $(BUILD)/mok_run

$(BUILD)/%.o: %.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# ptxas resource reports (registers, spills) go to build/ptxas/<file>.log; check-spills reads them.
$(BUILD)/%.o: %.cu $(HEADERS)
	@mkdir -p $(dir $@) $(BUILD)/ptxas
	$(NVCC) $(NVCCFLAGS) -c $< -o $@ 2> $(BUILD)/ptxas/$(subst /,_,$<).log || \
	  (cat $(BUILD)/ptxas/$(subst /,_,$<).log; exit 1)
	@grep -E "warning|error" $(BUILD)/ptxas/$(subst /,_,$<).log || true

# libmok.so exports exactly the functions of include/mok.h (src/api/exports.map); the tests link
# the same objects from libmok.a, so that they can call the internal launchers and entry points.
$(BUILD)/libmok.so: $(HOST_OBJS) $(CUDA_OBJS) src/api/exports.map
	$(CC) -shared -o $@ $(HOST_OBJS) $(CUDA_OBJS) -Wl,--version-script=src/api/exports.map $(LDLIBS)

# The benchmarks' library: the same objects and bench/driver (bench/driver/mok_bench.h), exporting
# the public API and the driver's mok_bench_* functions.
$(BUILD)/libmok_bench.so: $(HOST_OBJS) $(CUDA_OBJS) $(BUILD)/bench/driver/mok_bench.o src/api/exports.map
	sed 's/^  local:/    mok_bench_*;\n  local:/' src/api/exports.map > $(BUILD)/bench_exports.map
	$(CC) -shared -o $@ $(HOST_OBJS) $(CUDA_OBJS) $(BUILD)/bench/driver/mok_bench.o \
	  -Wl,--version-script=$(BUILD)/bench_exports.map $(LDLIBS)

$(BUILD)/libmok.a: $(HOST_OBJS) $(CUDA_OBJS)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/mok_tests: $(TEST_OBJS) $(BUILD)/libmok.a
	$(CC) -o $@ $(TEST_OBJS) $(BUILD)/libmok.a $(LDLIBS) $(if $(NVCC),-lcublas) $(NCCL_TEST_LIBS)

$(BUILD)/mok_run: $(BUILD)/tools/mok_run.o $(BUILD)/libmok.a
	$(CC) -o $@ $< $(BUILD)/libmok.a $(LDLIBS)

# Fails when any kernel spills registers to local memory, or when ptxas serializes wgmma
# (C7514/C7518: "wgmma.mma_async instructions are serialized"), which would silently undo a
# pipelined mainloop (the two-set fp8 loop of tile/pipeline.cuh relies on it).
check-spills: $(CUDA_OBJS)
	@if ls $(BUILD)/ptxas/*.log >/dev/null 2>&1; then \
	  if grep -h "spill" $(BUILD)/ptxas/*.log | grep -v " 0 bytes spill stores, 0 bytes spill loads" ; then \
	    echo "register spills found (see $(BUILD)/ptxas/)"; exit 1; \
	  elif grep -h "wgmma.mma_async instructions are serialized" $(BUILD)/ptxas/*.log ; then \
	    echo "ptxas serialized wgmma (see $(BUILD)/ptxas/)"; exit 1; \
	  else echo "no register spills or serialized wgmma in $(words $(CUDA_OBJS)) CUDA objects"; fi; \
	else echo "no CUDA objects built (nvcc not found)"; fi

# The Python binding's tests first (they need numpy and pytest; torch tests skip without torch),
# then the C tests, whose summary line closes the run. TESTS="a b": the tests whose names contain
# a or b (pytest -k "a or b"; mok_tests takes each as a filter).
empty :=
space := $(empty) $(empty)
test: $(BUILD)/mok_tests check-spills
	@if python3 -c "import numpy, pytest" 2>/dev/null; then \
	  python3 -m pytest -q tests/python $(if $(TESTS),-k "$(subst $(space), or ,$(strip $(TESTS)))"); \
	  rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; \
	else echo "SKIP python binding tests: numpy or pytest not installed (pip install numpy pytest)"; fi
	$(BUILD)/mok_tests $(TESTS)

# The C tests of a CPU-only build with AddressSanitizer and UndefinedBehaviorSanitizer (any
# finding fails the run), in build-sanitize/: the host code, the CPU reference and the API's
# misuse paths without invalid reads, leaks or undefined behaviour.
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
sanitize:
	$(MAKE) BUILD=build-sanitize NVCC= CC="$(CC) $(SAN_FLAGS)" LDLIBS="-lm -lpthread $(SAN_FLAGS)" \
	  build-sanitize/mok_tests
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  build-sanitize/mok_tests $(TESTS)

# The hardening campaign on a GPU machine (tests/gpu/test_fuzz.cu): FUZZ_CASES random layers
# against the CPU layer, split over FUZZ_JOBS processes with seeds 1..FUZZ_JOBS (the CPU reference
# is the slow side: about 1 s a case), then 10,000 forward + backward calls on one layer (no
# error, device memory flat). `make test` runs both at small counts.
FUZZ_CASES ?= 1000
FUZZ_JOBS  ?= 8
fuzz: $(BUILD)/mok_tests
	@seq 1 $(FUZZ_JOBS) | xargs -P $(FUZZ_JOBS) -I{} sh -c \
	  'MOK_FUZZ_CASES=$$(( ($(FUZZ_CASES) + $(FUZZ_JOBS) - 1) / $(FUZZ_JOBS) )) MOK_FUZZ_SEED={} \
	   $(BUILD)/mok_tests fuzz_gpu_layers_match_cpu > $(BUILD)/fuzz_{}.log 2>&1; rc=$$?; \
	   grep -E "random layers" $(BUILD)/fuzz_{}.log; exit $$rc'; fuzz=$$?; \
	MOK_SOAK_CALLS=10000 $(BUILD)/mok_tests fuzz_gpu_soak; soak=$$?; \
	echo "fuzz: logs in $(BUILD)/fuzz_*.log"; [ $$fuzz -eq 0 ] && [ $$soak -eq 0 ]

run: $(BUILD)/mok_run
	$(BUILD)/mok_run

# Benchmarks on the GPUs present (torch needed for the baselines); results go to bench/results/.
# They load build/libmok_bench.so (bench/driver), which `all` builds, and set no MOK_* variables:
# variants are struct fields and tuning values (src/common/tuning.h).
bench: all
	NCCL_NVLS_ENABLE=0 python3 bench/gemm.py
	python3 bench/forward.py
	python3 bench/ep.py
	@if [ "$$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then NCCL_NVLS_ENABLE=0 python3 bench/transport.py; \
	else echo "SKIP transport benchmark: needs 2 GPUs"; fi

# Which NCCL headers the build uses (empty: none, the transport reports MOK_ERROR_NOT_AVAILABLE)
# and the directory of the libnccl.so.2 that the run-time loader tries last.
nccl-info:
	@echo "NCCL_HOME=$(NCCL_HOME) NCCL_LIBDIR=$(NCCL_LIBDIR)"

clean:
	rm -rf $(BUILD) build-sanitize

# `make install PREFIX=/usr/local` (DESTDIR= for staging): include/mok.h, lib/libmok.so and
# lib/pkgconfig/mok.pc, so that `cc app.c $(pkg-config --cflags --libs mok)` builds against it
# (at run time the loader must find $(PREFIX)/lib: a system directory, or LD_LIBRARY_PATH).
# The version is the header's MOK_VERSION_*. `make uninstall PREFIX=...` removes the three files.
PREFIX      ?= /usr/local
MOK_VERSION := $(shell awk '/^\#define MOK_VERSION_(MAJOR|MINOR|PATCH) /{v = v (v == "" ? "" : ".") $$3} END {print v}' include/mok.h)

.PHONY: install uninstall
install: $(BUILD)/libmok.so
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 include/mok.h $(DESTDIR)$(PREFIX)/include/mok.h
	install -m 755 $(BUILD)/libmok.so $(DESTDIR)$(PREFIX)/lib/libmok.so
	printf '%s\n' 'prefix=$(PREFIX)' 'includedir=$${prefix}/include' 'libdir=$${prefix}/lib' '' \
	  'Name: mok' 'Description: Fused Mixture-of-Experts layer (C11/CUDA)' 'Version: $(MOK_VERSION)' \
	  'Cflags: -I$${includedir}' 'Libs: -L$${libdir} -lmok' > $(DESTDIR)$(PREFIX)/lib/pkgconfig/mok.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/include/mok.h $(DESTDIR)$(PREFIX)/lib/libmok.so \
	  $(DESTDIR)$(PREFIX)/lib/pkgconfig/mok.pc
