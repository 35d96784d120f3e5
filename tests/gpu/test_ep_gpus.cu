/*
 * test_ep_gpus.cu: the expert-parallel comparisons across real GPUs: ep_two_gpus_equal_one runs
 * test_ep_backward.cu's comparison on two GPUs (a thread per GPU, a unique-id communicator) and
 * skips with fewer; ranks whose descriptors differ are refused. Every test skips without a GPU.
 */
#include "ep_test_util.cuh"


/* ---------------------------------------------------------------------------------------------- */
/* Two real GPUs (skipped with fewer): the same checks across NVLink                               */
/* ---------------------------------------------------------------------------------------------- */

// One rank of a W-GPU team: a thread per GPU, since creating the communicator and the layer are
// collectives that block until every rank has called them.
typedef struct {
  int rank, W;
  const mok_unique_id_t *id;
  const bwd_problem_t *p;
  const int64_t *T;
  int64_t start, T_max;
  mokResult_t res;
  char msg[MOK_ERR_LEN];
  bwd_out_t out;  // dx, dtopk_w of its tokens; dw[0..2] its experts' slices; dw[3..5] shared
} ep_gpu_rank_t;

static void *ep_gpu_rank_main(void *arg) {
  ep_gpu_rank_t *k = (ep_gpu_rank_t *)arg;
  const bwd_problem_t *p = k->p;
  const fwd_problem_t &f = p->f;
  const int64_t T = k->T[k->rank], H = f.H, I = f.I, K = f.K, Is = f.Is, EL = f.E / k->W;
  cudaSetDevice(k->rank);
  mok_comm_t comm = NULL;
  mok_layer_t l = NULL;
  k->res = mok_comm_create_unique_id(&comm, k->id, k->rank, k->W, k->rank);
  mok_layer_desc_t d = bwd_desc(p);
  d.max_tokens = k->T_max;
  if (k->res == MOK_SUCCESS) k->res = mok_layer_create(&l, comm, &d);
  size_t ctx_bytes = 0;
  if (k->res == MOK_SUCCESS) k->res = mok_context_size(l, &ctx_bytes);
  if (k->res != MOK_SUCCESS) {
    snprintf(k->msg, sizeof(k->msg), "%s", mok_last_error());
    if (l) mok_layer_destroy(l);
    if (comm) mok_comm_destroy(comm);
    return NULL;
  }
  const size_t ew = (size_t)(EL * I * H), el = p->wdt == MOK_WGRAD_BF16 ? 2 : 4;
  auto up = [](const void *h, size_t n) { return test_dev_copy(h, n); };
  void *x = up(f.x.data() + k->start * H, (size_t)(T * H) * 2);
  void *idx = up(f.idx.data() + k->start * K, (size_t)(T * K) * 4);
  void *tw = up(f.tw.data() + k->start * K, (size_t)(T * K) * 4);
  void *dy = up(p->dy.data() + k->start * H, (size_t)(T * H) * 2);
  void *wg = up(f.wg.data() + k->rank * ew, ew * 2), *wu = up(f.wu.data() + k->rank * ew, ew * 2);
  void *wd = up(f.wd.data() + k->rank * ew, ew * 2);
  void *wsg = Is ? up(f.wsg.data(), (size_t)(Is * H) * 2) : NULL;
  void *wsu = Is ? up(f.wsu.data(), (size_t)(Is * H) * 2) : NULL;
  void *wsd = Is ? up(f.wsd.data(), (size_t)(H * Is) * 2) : NULL;
  void *y = NULL, *dx = NULL, *dtw = NULL, *ctx = NULL, *dw[6] = {NULL};
  cudaMalloc(&y, (size_t)(k->T_max * H) * 2 + 16);
  cudaMalloc(&dx, (size_t)(k->T_max * H) * 2 + 16);
  cudaMalloc(&dtw, (size_t)(k->T_max * K) * 4 + 16);
  cudaMalloc(&ctx, ctx_bytes);
  for (int i = 0; i < (Is ? 6 : 3); i++) cudaMalloc(&dw[i], (i < 3 ? ew : (size_t)(Is * H)) * el + 16);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  mok_weights_t w;
  memset(&w, 0, sizeof(w));
  w.wg = wg, w.wu = wu, w.wd = wd, w.wsg = wsg, w.wsu = wsu, w.wsd = wsd;
  const mok_forward_args_t a = test_forward_args(T, x, (const int32_t *)idx, (const float *)tw, w);
  const mok_backward_args_t b = test_backward_args(T, dy, dx, (float *)dtw, dw, Is > 0);
  k->res = mok_forward(l, &a, T ? y : NULL, ctx, ctx_bytes, (mok_stream_t)s);
  if (k->res == MOK_SUCCESS) k->res = mok_backward(l, &a, &b, ctx, ctx_bytes, (mok_stream_t)s);
  if (k->res == MOK_SUCCESS) k->res = mok_layer_check(l);
  if (k->res != MOK_SUCCESS) snprintf(k->msg, sizeof(k->msg), "%s", mok_last_error());
  cudaStreamSynchronize(s);
  k->out.dx.assign((size_t)(T * H), 0);
  k->out.dtw.assign((size_t)(T * K), 0.0f);
  std::vector<uint16_t> yv((size_t)(T * H));
  if (T > 0) {
    cudaMemcpy(yv.data(), y, yv.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(k->out.dx.data(), dx, k->out.dx.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(k->out.dtw.data(), dtw, k->out.dtw.size() * 4, cudaMemcpyDeviceToHost);
  }
  k->out.dw[0] = std::vector<uint8_t>((const uint8_t *)yv.data(), (const uint8_t *)(yv.data() + yv.size()));
  for (int i = 0; i < 3; i++) {
    k->out.dw[1 + i].assign(ew * el, 0);
    cudaMemcpy(k->out.dw[1 + i].data(), dw[i], ew * el, cudaMemcpyDeviceToHost);
  }
  void *bufs[] = {x, idx, tw, dy, wg, wu, wd, wsg, wsu, wsd, y, dx, dtw, ctx, dw[0], dw[1], dw[2],
                  dw[3], dw[4], dw[5]};
  for (void *q : bufs)
    if (q) cudaFree(q);
  cudaStreamDestroy(s);
  mok_layer_destroy(l);
  mok_comm_destroy(comm);
  return NULL;
}

// W GPUs, one thread each, against the W = 1 layer on GPU 0: y, dx, dtopk_w and every routed
// expert's weight gradients bitwise. (out.dw[0] carries y; dw[1..3] the rank's dWg, dWu, dWd.)
MOK_TEST(ep_two_gpus_equal_one) {
  NEED_GPU();
  int n = 0;
  cudaGetDeviceCount(&n);
  if (n < 2) MOK_SKIP("needs 2 GPUs (NVLink peers), found 1");
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast (DESIGN.md section 5)
  bwd_problem_t p;
  ep_bwd_problem(&p, 128, 300, test_route_uniform(0.1));
  const int64_t T[2] = {211, 89};
  bwd_out_t ref;
  const bwd_problem_t all = ep_slice(&p, 0, 300);
  MOK_REQUIRE(ep_w1_backward(&all, &ref));
  const std::vector<uint16_t> yref = ep_reference_y(&p.f, 300);
  mok_unique_id_t id;
  const mokResult_t idr = mok_get_unique_id(&id);
  MOK_REQUIRE_MSG(idr == MOK_SUCCESS, "mok_get_unique_id: %s", mok_last_error());
  ep_gpu_rank_t k[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    k[r].rank = r, k[r].W = 2, k[r].id = &id, k[r].p = &p, k[r].T = T;
    k[r].start = r ? T[0] : 0, k[r].T_max = 256;
    k[r].msg[0] = '\0';
    pthread_create(&th[r], NULL, ep_gpu_rank_main, &k[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  const int64_t H = p.f.H, K = p.f.K;
  const size_t ew = (size_t)(p.f.E / 2 * p.f.I * H) * 4;  // fp32 weight gradients
  for (int r = 0; r < 2; r++) {
    MOK_EXPECT_MSG(k[r].res == MOK_SUCCESS, "rank %d: %s", r, k[r].msg);
    if (k[r].res != MOK_SUCCESS) continue;
    const int64_t s = k[r].start;
    MOK_EXPECT_MSG(memcmp(k[r].out.dw[0].data(), yref.data() + s * H, (size_t)(T[r] * H) * 2) == 0,
                   "rank %d: y differs from W = 1", r);
    MOK_EXPECT_MSG(memcmp(k[r].out.dx.data(), ref.dx.data() + s * H, (size_t)(T[r] * H) * 2) == 0,
                   "rank %d: dx differs from W = 1", r);
    MOK_EXPECT_MSG(memcmp(k[r].out.dtw.data(), ref.dtw.data() + s * K, (size_t)(T[r] * K) * 4) == 0,
                   "rank %d: dtopk_w differs from W = 1", r);
    for (int i = 0; i < 3; i++)
      MOK_EXPECT_MSG(memcmp(k[r].out.dw[1 + i].data(), ref.dw[i].data() + r * ew, ew) == 0,
                     "rank %d: %s differs from W = 1's slice", r, bwd_w_name[i]);
  }
}

// Ranks whose layers differ (here max_tokens): a virtual rank's layer create refuses a window of
// another size than rank 0's, naming the rule, and the communicators stay usable. (On real
// ranks the transport's layout refuses such a call on every rank, and mok_layer_check names the
// other rank's max_tokens: ep_verdict, MOK_WS_ERR_PEER_SHAPE.)
MOK_TEST(ep_ranks_with_other_descriptors_are_refused) {
  NEED_GPU();
  mok_comm_t c[2] = {NULL, NULL};
  MOK_REQUIRE(mok_comm_create_virtual(c, 2, 0) == MOK_SUCCESS);
  mok_layer_desc_t d = test_layer_desc(256, 256, 16, 4, 0, 128);
  mok_layer_t l0 = NULL, l1 = NULL;
  MOK_EXPECT(mok_layer_create(&l0, c[0], &d) == MOK_SUCCESS);
  d.max_tokens = 256;
  const mokResult_t r = mok_layer_create(&l1, c[1], &d);
  MOK_EXPECT_MSG(r == MOK_ERROR_INVALID_VALUE && l1 == NULL &&
                     strstr(mok_last_error(), "same layers in the same order"),
                 "rank 1's create: %s (%s)", mok_error_string(r), mok_last_error());
  if (l1) mok_layer_destroy(l1);
  mok_layer_destroy(l0);
  MOK_EXPECT(mok_comm_destroy(c[0]) == MOK_SUCCESS && mok_comm_destroy(c[1]) == MOK_SUCCESS);
}
