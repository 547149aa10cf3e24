/* Per-link totals of the NCCL profiler plugin: see nccl_links.h. */
#include "nccl_links.h"

#include <string.h>

#include "spinlock.h"

#define MAX_LINKS 2048u /* power of two; one per (comm, peer, direction) */

enum { LINK_FREE = 0, LINK_USED = 1, LINK_GONE = 2 /* tombstone: keeps probe chains */ };

struct link {
  uint32_t state;
  uint32_t comm_gen;
  const void* comm;
  int32_t peer; /* comm-local */
  uint8_t direction;
  ccld_board* board;
  int32_t slot;
  uint64_t wait_ns[4];
  ccld_channel rec;
};

static struct link g_links[MAX_LINKS];
static uint32_t g_links_lock;

static uint32_t hash(const void* comm, int32_t peer, uint8_t direction) {
  uint64_t h = (uint64_t)(uintptr_t)comm ^ ((uint64_t)(uint32_t)peer << 1) ^ direction;
  h *= 0x9E3779B97F4A7C15ull;
  return (uint32_t)(h >> 40) & (MAX_LINKS - 1);
}

/* The link of the key, or a new one (NULL when full); called with the lock held. */
static struct link* find(ccld_board* b, const void* comm, uint32_t gen, int32_t peer,
                         const ccld_channel* rec) {
  struct link* spare = NULL;
  uint32_t h = hash(comm, peer, rec->direction);
  for (uint32_t n = 0; n < MAX_LINKS; n++) {
    struct link* l = &g_links[(h + n) & (MAX_LINKS - 1)];
    if (l->state == LINK_FREE) {
      if (!spare) spare = l;
      break;
    }
    if (l->state == LINK_GONE) {
      if (!spare) spare = l;
      continue;
    }
    if (l->comm == comm && l->comm_gen == gen && l->peer == peer &&
        l->direction == rec->direction && l->board == b)
      return l;
  }
  if (!spare) return NULL;
  int32_t slot = ccld_channel_claim(b, CCLD_SRC_NCCL);
  if (slot < 0) return NULL;
  memset(spare, 0, sizeof *spare);
  spare->state = LINK_USED;
  spare->comm = comm;
  spare->comm_gen = gen;
  spare->peer = peer;
  spare->direction = rec->direction;
  spare->board = b;
  spare->slot = slot;
  spare->rec.source = CCLD_SRC_NCCL;
  spare->rec.direction = rec->direction;
  spare->rec.wait = CCLD_WAIT_NONE;
  spare->rec.channel_id = CCLD_CHANNEL_TOTAL;
  spare->rec.first_ns = ccld_now_ns();
  return spare;
}

int ccld_link_add(ccld_board* b, const void* comm, uint32_t comm_gen, int32_t local_peer,
                  const ccld_channel* rec, const uint64_t wait_ns[4]) {
  if (!b || !comm || rec->peer == CCLD_NO_RANK) return 0;
  ccld_spin_lock(&g_links_lock);
  struct link* l = find(b, comm, comm_gen, local_peer, rec);
  if (!l) {
    ccld_spin_unlock(&g_links_lock);
    return -1;
  }
  for (int i = 0; i < 4; i++) l->wait_ns[i] += wait_ns[i];
  l->rec.peer = rec->peer;
  l->rec.pid = rec->pid;
  l->rec.group_id = rec->group_id;
  l->rec.seq = rec->seq;
  l->rec.steps_posted += rec->steps_posted;
  l->rec.steps_done += rec->steps_done;
  l->rec.bytes_done += rec->bytes_done;
  l->rec.last_progress_ns = ccld_now_ns();
  l->rec.sndbuf_limited_us = l->wait_ns[CCLD_WAIT_LOCAL] / 1000;
  l->rec.rwnd_limited_us = l->wait_ns[CCLD_WAIT_PEER] / 1000;
  l->rec.busy_us = l->wait_ns[CCLD_WAIT_NETWORK] / 1000;
  if (ccld_process_board() == l->board) ccld_channel_write(l->board, l->slot, &l->rec);
  ccld_spin_unlock(&g_links_lock);
  return 0;
}

void ccld_link_drop_comm(const void* comm) {
  ccld_spin_lock(&g_links_lock);
  for (uint32_t i = 0; i < MAX_LINKS; i++) {
    struct link* l = &g_links[i];
    if (l->state != LINK_USED || l->comm != comm) continue;
    if (ccld_process_board() == l->board) ccld_channel_release(l->board, l->slot);
    l->state = LINK_GONE;
  }
  ccld_spin_unlock(&g_links_lock);
}
