/*
 * forward/fused_ep.cuh: the fused forward's expert-parallel parts (src/gpu/forward_ep.c): the
 * dispatch at the start of the kernel, and the waits of GATE_UP tiles for the rows of their
 * source ranks.
 *
 * The dispatch. Before the warps take their roles, the CTAs that run first take dispatch units
 * from MOK_FC_COMM: n_comm units (the transport's CTA count, which every receiver's targets
 * assume), each run by the whole CTA with the transport's dispatch (comm/transport.cuh,
 * tp_dispatch_send: tokens claimed one at a time by warps, a token crossing to each other rank
 * that holds one of its experts once, with its rows' router weights and sources), then signalled
 * to every rank. The first unit sends every token (the claims run out), the others only signal.
 * Rows of this rank's own tokens never move (prep wrote their router weights and sources).
 *
 * The waits. A GATE_UP tile's rows are one expert's, in (source rank, token, slot) order, so the
 * tile covers a run of source ranks, known from the layout's all-gathered counts; before
 * gathering, the producer's thread 0 waits until every other rank of the run has signalled all
 * its units of this call (disp_ctr[s] >= epoch * num_ctas[s], system-scope acquire), and
 * remembers the ranks it has seen complete. Then the producer warps meet (a named barrier), so
 * their gathers (cp.async.cg, at L2) follow the acquire; the row sources and router weights
 * are read at L2 too (.cg): L1 is not coherent with other GPUs' stores. The plan puts the shared
 * expert's tiles first (task_plan.h, shared_first): they read this rank's tokens and wait on no
 * rank, so the first tickets keep the SMs busy while the other ranks' rows are in flight.
 *
 * NOTE (deadlock freedom across ranks): a dispatch unit waits on nothing, and a CTA takes units
 * before any task, so a rank's dispatch completes as soon as one CTA of its kernel runs; every
 * other wait is the W = 1 kernel's. On real GPUs each rank's kernel has its own GPU. Virtual
 * ranks share one: rank r's CTAs spin on rank s's dispatch while holding SMs, so s's kernel must
 * find an SM; src/gpu/forward_ep.c (ep_dispatch_in_kernel) lets a virtual rank's kernel
 * dispatch only with at most (SMs - W) / W CTAs, so that all W kernels and the other ranks'
 * layout and prep kernels fit at once.
 * A wait that times out records MOK_ERROR_TIMEOUT in the transport's error word (rank, counter
 * MOK_TP_WAIT_DISPATCH, the source rank, value and target; mok_layer_check reports it) and raises
 * MOK_FC_ABORT: the kernel then runs to its end with wrong results instead of hanging.
 */
#ifndef MOK_CUDA_FORWARD_FUSED_EP_CUH
#define MOK_CUDA_FORWARD_FUSED_EP_CUH

#include "cuda/comm/transport.cuh"
#include "cuda/forward/fused_tile.cuh"

// The call's dispatch epoch (every CTA reads it at its start: tp_epoch_end at the kernel's end).
__device__ __forceinline__ uint64_t fk_dispatch_epoch(const fk_params_t &p) {
  return p.n_comm > 0 ? tp_epoch_begin(p.tp, TP_EPOCH_DISPATCH) : 0;
}

// Dispatch units until none is left (the whole CTA, before the roles).
__device__ __noinline__ void fk_dispatch(const fk_params_t &p, uint64_t epoch) {
  __shared__ uint32_t s_unit;
  tp_claims_reset_next(p.tp, TP_CLAIM_DISPATCH, epoch);  // CTA 0: the next call's token claims
  for (;;) {
    if (threadIdx.x == 0) s_unit = atomicAdd(p.counters + MOK_FC_COMM, 1u);
    __syncthreads();
    if (s_unit >= (uint32_t)p.n_comm) break;
    tp_dispatch_send(p.tp, epoch);
    tp_cta_signal_ranks(p.tp, p.tp.win.disp_ctr);  // every thread's stores, then the release
    __syncthreads();                               // s_unit is read by every thread
  }
}

// One thread: until *ctr >= target (system scope), an abort, or the timeout. 1: reached.
__device__ __noinline__ int fk_wait_rank(const fk_params_t &p, const uint64_t *ctr,
                                         uint64_t target, int source) {
  uint64_t v = ptx_ld_acquire_sys_u64(ctr);
  if (v >= target) return 1;
  const uint64_t t0 = ptx_globaltimer_ns();
  for (;;) {
    __nanosleep(64);
    v = ptx_ld_acquire_sys_u64(ctr);
    if (v >= target) return 1;
    if (*(volatile uint32_t *)(p.counters + MOK_FC_ABORT) ||
        *(volatile int32_t *)&p.tp.err->abort)
      return 0;
    if (ptx_globaltimer_ns() - t0 > p.timeout_ns) {
      tp_record_error(p.tp.err, MOK_ERROR_TIMEOUT, 1, p.tp.rank, MOK_TP_WAIT_DISPATCH, source, v,
                      target, 0, 0, 0);
      atomicExch(p.counters + MOK_FC_ABORT, 1u);
      return 0;
    }
  }
}

// Producer thread 0, before gathering rows [rel0, rel1) of local expert e (relative to the
// expert's first row): waits for the other ranks among those rows' sources. *arrived: the ranks
// already seen complete in this call (bit s), this rank's own from the start.
__device__ __noinline__ void fk_wait_sources(const fk_params_t &p, int e, int64_t rel0,
                                             int64_t rel1, uint64_t epoch, uint32_t *arrived) {
  const int W = p.tp.nranks;
  const int64_t g = (int64_t)p.tp.rank * p.tp.EL + e;  // the expert's global id
  const uint64_t *ctr = (const uint64_t *)(p.tp.peer[p.tp.rank] + p.tp.win.disp_ctr);
  int64_t start = 0;  // first row of source s within the expert
  for (int s = 0; s < W && start < rel1; s++) {
    const int64_t c = p.tp.lay.count[(int64_t)s * p.tp.E + g];
    if (c > 0 && start + c > rel0 && !((*arrived >> s) & 1u)) {
      if (!fk_wait_rank(p, ctr + s, epoch * (uint64_t)p.tp.lay.num_ctas[s], s)) return;
      *arrived |= 1u << s;
    }
    start += c;
  }
}

#endif /* MOK_CUDA_FORWARD_FUSED_EP_CUH */
