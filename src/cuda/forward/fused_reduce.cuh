/*
 * forward/fused_reduce.cuh: the fused forward's REDUCE: token by token, one warp per token, in slot
 * order (forward/rows.cuh's sum), each token once the tiles it needs are done.
 */
#ifndef MOK_CUDA_FORWARD_FUSED_REDUCE_CUH
#define MOK_CUDA_FORWARD_FUSED_REDUCE_CUH

#include "cuda/forward/fused_tile.cuh"
#include "cuda/forward/rows.cuh"
// DN[e]'s target: both consumer warpgroups' releases of each of expert e's DOWN tiles.
__device__ __forceinline__ uint32_t fk_dn_target(const mok_task_plan_t &plan, int32_t e) {
  return 2u * (uint32_t)(plan.n_down * (plan.mt_pre[e + 1] - plan.mt_pre[e]));
}

// The reduce, token by token (forward/rows.cuh's sum, one warp per token): lane 0 claims the next
// token from MOK_FC_CLAIM and waits until its inputs are complete, then the warp sums it. Until
// the tokens are gone. With by_last, claim c is token red_order[c], whose highest expert is b - 1
// for the bin b with red_pre[b] <= c < red_pre[b + 1]; it waits for the DOWN tiles of experts
// 0 .. b - 1 (DN; all of them, not only its own: experts finish about in order, and one watermark
// per warp then costs one wait per expert instead of K per token). Else claim c is token c, which
// waits for every DOWN tile (MOK_FC_DOWN) and for its token tile's SHARED_DOWN tiles. Claims go in
// that order, so a warp's waits pass the counters in order: it remembers what it saw complete.
// Any warp of the CTA may call it, alone.
// Each lane keeps two chunks' loads in flight (rl_reduce_token<2>): against one, the 3 helper warps
// per SM beside the shared expert left a 85 us tail instead of 320 at DeepSeek-V3, and the final
// reduce on all 12 warps took 308 us instead of 330 at Qwen3-235B (docs/performance.md, "Fused forward: reduce helpers").
// NOTE (deadlock freedom): a token waits only on tile tasks, which wait on nothing a reduce does.
__device__ __noinline__ void fk_reduce_claims(const fk_params_t &p, const mok_task_plan_t &plan) {
  if (plan.no_reduce) return;  // expert parallel: the reduce comes after the combine
  const int lane = threadIdx.x & 31;
  // REDUCE(0)'s task number (a timed-out wait reports the REDUCE task of its token)
  const int64_t H8 = p.H / 8, reduce0 = mok_plan_num_tasks(&plan) - plan.t_tiles;
  const bool by_last = p.by_last;  // (the host sets it only without a shared expert)
  int32_t bin = 0;         // (lane 0) the bin of the last claim (by_last)
  int32_t ready = 0;       // experts 0 .. ready - 1 have all their DOWN tiles done
  int64_t tile_done = -1;  // (lane 0) token tiles up to this one: their shared tiles are done
  for (;;) {
    int64_t t = p.T;
    int32_t need = plan.E;  // experts whose DOWN tiles the token needs: 0 .. need - 1
    if (lane == 0) {
      const int64_t c = (int64_t)atomicAdd(p.counters + MOK_FC_CLAIM, 1u);
      if (c < p.T && by_last) {
        while (p.red_pre[bin + 1] <= c) bin++;
        t = p.red_order[c];
        need = bin;
      } else if (c < p.T) {
        t = c;
      }
    }
    t = __shfl_sync(0xffffffffu, t, 0);
    if (t >= p.T) return;
    need = __shfl_sync(0xffffffffu, need, 0);
    const int64_t tile = t / FK_BM;
    if (!by_last && ready < plan.E) {  // every DOWN tile, counted in MOK_FC_DOWN
      if (lane == 0)
        fk_wait(p, MOK_FC_DOWN, 2u * (uint32_t)(plan.n_down * plan.mt_pre[plan.E]),
                reduce0 + tile, 1000);
      ready = plan.E;
    }
    // Experts ready .. need - 1, 32 at a time, a counter per lane; the first one not done is waited
    // for (lane 0), then the scan goes on after it. (Expert by expert, the 128 waits of the first
    // claim cost a final reduce ~30-50 us at the Qwen3 shapes.)
    while (ready < need) {
      const int32_t e = ready + lane;
      bool done = true;
      if (e < need)
        done = ptx_ld_acquire_gpu(p.counters + p.dn_base + e) >= fk_dn_target(plan, e);
      const uint32_t ok = __ballot_sync(0xffffffffu, done);
      if (ok == 0xffffffffu) {
        ready = ready + 32 < need ? ready + 32 : need;
        continue;
      }
      ready += __ffs(~ok) - 1;
      if (lane == 0)
        fk_wait(p, (int)p.dn_base + ready, fk_dn_target(plan, ready), reduce0 + tile, 1000);
      __syncwarp();
      ready++;
    }
    if (lane == 0 && plan.n_sd > 0 && tile > tile_done) {
      fk_wait(p, (int)p.sd_base + (int)tile, 2u * (uint32_t)plan.n_sd, reduce0 + tile, 1000);
      tile_done = tile;
    }
    __syncwarp();  // each lane's acquire (and lane 0's waits) order the other lanes' reads too
    rl_reduce_token<2>(p.slot_row + t * p.K, p.K, H8, (const uint4 *)p.yk,
                       p.ys ? (const float4 *)p.ys + t * (H8 * 2) : NULL, (uint4 *)p.y + t * H8,
                       lane);
  }
}

#endif /* MOK_CUDA_FORWARD_FUSED_REDUCE_CUH */
