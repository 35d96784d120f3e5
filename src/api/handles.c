/* handles.c: the set of live handles (communicators and layers), so that every entry point can
 * tell a live handle from a destroyed one or from a pointer that never was a handle without
 * reading the memory it points to (which may have been freed, unmapped or reused).
 *
 * An open-addressing hash set of (pointer, kind) under one mutex: linear probing, capacity a
 * power of two kept at most half full, deletion by backward shift (no tombstones). A process holds
 * few handles (a layer per MoE layer of a model), so the lock is uncontended and a lookup costs
 * tens of nanoseconds beside calls that launch kernels. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "api/api.h"

typedef struct {
  uintptr_t key; /* 0: empty */
  int kind;
} handle_slot_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static handle_slot_t *g_slots;
static size_t g_cap, g_count; /* g_cap: 0 or a power of two */

static size_t slot_of(uintptr_t key, size_t cap) {
  uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing of the address */
  return (size_t)(h >> 32) & (cap - 1);
}

/* The slot holding key, or the empty slot where it would go. g_cap > 0, lock held. */
static size_t find(uintptr_t key) {
  size_t i = slot_of(key, g_cap);
  while (g_slots[i].key != 0 && g_slots[i].key != key) i = (i + 1) & (g_cap - 1);
  return i;
}

static int grow(void) {
  const size_t cap = g_cap ? 2 * g_cap : 64;
  handle_slot_t *old = g_slots, *slots = calloc(cap, sizeof(*slots));
  if (!slots) return 0;
  const size_t old_cap = g_cap;
  g_slots = slots, g_cap = cap;
  for (size_t i = 0; i < old_cap; i++)
    if (old[i].key) g_slots[find(old[i].key)] = old[i];
  free(old);
  return 1;
}

int mok_handle_add(const void *h, int kind) {
  const uintptr_t key = (uintptr_t)h;
  if (!key) return 0;
  pthread_mutex_lock(&g_mu);
  int ok = 2 * (g_count + 1) <= g_cap || grow();
  if (ok) {
    const size_t i = find(key);
    if (!g_slots[i].key) g_count++;
    g_slots[i].key = key, g_slots[i].kind = kind;
  }
  pthread_mutex_unlock(&g_mu);
  return ok;
}

/* Lock held: 1 when key is live with this kind; with `take` it is then removed. */
static int lookup(uintptr_t key, int kind, int take) {
  if (!key || !g_cap) return 0;
  size_t i = find(key);
  if (g_slots[i].key != key || g_slots[i].kind != kind) return 0;
  if (take) { /* backward shift: move later entries of the run into the hole when they may */
    g_slots[i].key = 0, g_count--;
    for (size_t j = (i + 1) & (g_cap - 1); g_slots[j].key; j = (j + 1) & (g_cap - 1)) {
      const size_t home = slot_of(g_slots[j].key, g_cap);
      /* j's entry may fill the hole at i unless its home lies cyclically in (i, j] */
      const int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
      if (stays) continue;
      g_slots[i] = g_slots[j], g_slots[j].key = 0, i = j;
    }
  }
  return 1;
}

int mok_handle_live(const void *h, int kind) {
  pthread_mutex_lock(&g_mu);
  const int live = lookup((uintptr_t)h, kind, 0);
  pthread_mutex_unlock(&g_mu);
  return live;
}

int mok_handle_take(const void *h, int kind) {
  pthread_mutex_lock(&g_mu);
  const int live = lookup((uintptr_t)h, kind, 1);
  pthread_mutex_unlock(&g_mu);
  return live;
}
