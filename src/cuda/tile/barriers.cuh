/*
 * tile/barriers.cuh: every named barrier (bar.sync / bar.arrive ids 1-15; 0 is __syncthreads) of
 * MoK's kernels, allocated here so that the ids a kernel uses can be seen to be distinct.
 */
#ifndef MOK_CUDA_TILE_BARRIERS_CUH
#define MOK_CUDA_TILE_BARRIERS_CUH

enum {
  /* Grouped GEMMs (gemm/grouped_gemm.cu, gemm/grouped_gemm_fp8.cuh, gemm/grouped_wgrad.cu). */
  MOK_BAR_GEMM_EPI = 1,     /* + cw: consumer warpgroup cw's staged epilogue (128 threads) */
  MOK_BAR_WGRAD_ZERO = 3,   /* weight-gradient GEMM: both consumer warpgroups (256 threads) */
  MOK_BAR_GEMM_MX = 4,      /* MXFP8 B: a stage's B converted by both consumer warpgroups (256) */
  /* The fused forward (forward/fused*.cuh). */
  MOK_BAR_FUSED_TICKET = 1, /* the producer warps still loading read the next ticket (32 each) */
  MOK_BAR_FUSED_EPI = 2     /* + cw: consumer warpgroup cw's epilogue and releases (128) */
};
static_assert(MOK_BAR_GEMM_EPI + 1 < MOK_BAR_WGRAD_ZERO && MOK_BAR_WGRAD_ZERO < MOK_BAR_GEMM_MX,
              "GEMM barriers overlap");
static_assert(MOK_BAR_FUSED_TICKET < MOK_BAR_FUSED_EPI && MOK_BAR_FUSED_EPI + 1 < 16,
              "fused forward barriers overlap or exceed the 16 of a CTA");

#endif /* MOK_CUDA_TILE_BARRIERS_CUH */
