/* NCCL profiler plugin (interface v4, v5, v6): per-channel progress of GPU collectives,
 * written to the board.
 *
 * NCCL raises events on two kinds of threads:
 *  - the caller's thread, inside the NCCL call: Group, Coll, P2p, and from v5 the API
 *    events. The tracer has just set the thread's current trace id (ccld_op_enter), so a
 *    Coll/P2p is bound to its (group_id, seq) exactly, and its communicator to the group.
 *  - the proxy thread (KernelCh also from NCCL's own profiler thread in newer releases):
 *    ProxyOp, ProxyStep, KernelCh. These become channel records on the board, one per
 *    (op, channel, peer, direction), rewritten at every step transition and released when
 *    the last proxy op using the record stops. A KernelCh gets a record of its own (peer
 *    CCLD_NO_RANK, no steps): "this op's kernel is running on channel c".
 *
 * Peers: NCCL names peers by communicator-local rank. `peer` on the board is a global rank
 * when the comm's rank order is known, and CCLD_NO_RANK otherwise; we never store a
 * comm-local rank there. A comm's order is known when (1) its bound group is on the board
 * with size == nranks and my_index == rank: torch creates a group's NCCL comm with comm
 * rank == group rank, and the board's rank list is in group-rank order; or (2) it is a
 * 2-rank comm first used by a traced P2P op, whose op record names the global peer
 * (torch's dedicated send/recv comms).
 *
 * Memory: static, fixed-size tables; no allocation per event or per communicator.
 *  - comms: one slot per communicator (init/finalize).
 *  - tasks: Coll/P2p/API handles in a ring overwritten in order, never freed. NCCL uses a
 *    Coll's handle as the parent of its proxy ops after stopping the Coll (stop means
 *    "enqueued"), and nothing tells us when the last child has started. A child whose
 *    parent slot has been reused since gets the newer task's trace; that needs more than
 *    TASK_RING task events of proxy lag on one comm (reuse by another comm is detected).
 *  - events: ProxyOp/ProxyStep/KernelCh handles, a lock-free free list.
 *  - trackers: our side of each channel record (key, refcount, the record last written),
 *    in a hash table under one spinlock, taken only at ProxyOp/KernelCh start and stop
 *    and at finalize.
 * Handles that NCCL passes back are range-checked against these tables before use, and a
 * ProxyOp raised for another process (PXN) never has its parentObj looked at.
 * Every function but init returns 0; init fails only on invalid arguments.
 */
#define _GNU_SOURCE
#include "nccl_profiler_abi.h"

#include <string.h>
#include <unistd.h>

#include "board.h"
#include "nccl_links.h"
#include "spinlock.h"

#define MAX_COMMS 1024u
#define TASK_RING 16384u /* power of two */
#define EVENT_POOL 32768u
#define MAX_TRACKERS 4096u
#define TRACKER_BUCKETS 4096u /* power of two */
#define STEP_WINDOW 8u        /* NCCL_STEPS: live steps of one proxy op, indexed step % 8 */
#define NCCL_LOG_SUBSYS_INIT 1ul

#define MASK_V4                                                                   \
  (CCLD_NCCL_EV_COLL | CCLD_NCCL_EV_P2P | CCLD_NCCL_EV_PROXY_OP | CCLD_NCCL_EV_PROXY_STEP | \
   CCLD_NCCL_EV_KERNEL_CH)
/* From v5 the API events are raised synchronously on the caller's thread even when the
 * launch (and so the Coll event) happens elsewhere, e.g. on a non-blocking comm. */
#define MASK_V5 (MASK_V4 | CCLD_NCCL_EV_COLL_API | CCLD_NCCL_EV_P2P_API)

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define RLOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define RSTORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define COUNT(field) __atomic_add_fetch(&g_stats.field, 1, __ATOMIC_RELAXED)

/* ---------------------------------------------------------------- ABI checks (LP64) */
#if defined(__LP64__)
_Static_assert(sizeof(ccld_nccl_result_t) == 4, "ncclResult_t is int-sized");
_Static_assert(offsetof(ccld_nccl_descr_v4_t, parentObj) == 8, "descr head");
_Static_assert(offsetof(ccld_nccl_descr_v4_t, rank) == 16, "descr head");
_Static_assert(offsetof(ccld_nccl_descr_v4_t, coll) == 24, "descr union");
_Static_assert(offsetof(ccld_nccl_descr_v5_t, coll) == 24, "descr union");
_Static_assert(offsetof(ccld_nccl_descr_v6_t, coll) == 24, "descr union");
_Static_assert(offsetof(struct ccld_nccl_coll_v4, nChannels) == 56, "coll");
_Static_assert(offsetof(struct ccld_nccl_coll_v4, proto) == 72, "coll");
_Static_assert(offsetof(struct ccld_nccl_coll_v5, parentGroup) == 80, "coll v5");
_Static_assert(offsetof(struct ccld_nccl_p2p_v4, peer) == 32, "p2p");
_Static_assert(offsetof(struct ccld_nccl_p2p_v5, parentGroup) == 40, "p2p v5");
_Static_assert(offsetof(struct ccld_nccl_proxy_op, channelId) == 4, "proxyOp");
_Static_assert(offsetof(struct ccld_nccl_proxy_op, peer) == 8, "proxyOp");
_Static_assert(offsetof(struct ccld_nccl_proxy_op, isSend) == 20, "proxyOp");
_Static_assert(offsetof(struct ccld_nccl_kernel_ch, pTimer) == 8, "kernelCh");
_Static_assert(offsetof(struct ccld_nccl_ce_coll, stream) == 80, "ceColl");
_Static_assert(sizeof(ccld_nccl_state_args_t) == 8, "state args");
_Static_assert(offsetof(ccld_nccl_profiler_v4_t, finalize) == 40, "plugin struct");
_Static_assert(offsetof(ccld_nccl_profiler_v6_t, finalize) == 40, "plugin struct");
#endif

/* The union members we read (proxyOp, proxyStep, kernelCh) have one layout in every
 * version, at offset 24, so the core reads all versions through this view. */
typedef union {
  struct ccld_nccl_proxy_op proxyOp;
  struct ccld_nccl_proxy_step proxyStep;
  struct ccld_nccl_kernel_ch kernelCh;
} descr_body;
#define BODY(d) ((const descr_body*)(const void*)&(d)->coll)

/* ---------------------------------------------------------------- state */
enum { COMM_FREE = 0, COMM_CLAIMED = 1, COMM_LIVE = 2 };
enum { MAP_NONE = 0, MAP_GROUP = 1, MAP_PAIR = 2 };

struct comm {
  uint32_t state;     /* COMM_* */
  uint32_t gen;       /* bumped at finalize: tells a reused slot from its previous comm */
  uint32_t map;       /* MAP_*: how comm-local ranks become global ranks */
  int32_t rank, nranks;
  int32_t group_slot; /* MAP_GROUP: board group slot */
  int32_t pair_peer;  /* MAP_PAIR: global rank of the other member */
  uint64_t comm_id;   /* v4 commHash, v5+ commId */
  uint64_t group_id;  /* 0 until the first traced Coll/P2p binds the comm */
};

enum { TASK_COLL = 1, TASK_P2P = 2, TASK_COLL_API = 3, TASK_P2P_API = 4 };

struct task {
  uint32_t lock; /* seqlock: written on the caller's thread, read on the proxy thread */
  uint8_t kind;
  uint8_t traced;
  uint32_t comm_gen;
  const struct comm* comm;
  uint64_t ticket; /* unique per task: keys the channel records its proxy ops share */
  uint64_t group_id;
  uint64_t seq;
  uint64_t index;  /* traced: the ring index of the tracer's op record */
  int64_t host_ns; /* when the caller raised it: before its kernel was launched */
};

enum { EV_FREE = 0, EV_PROXY_OP = 1, EV_PROXY_STEP = 2, EV_KERNEL_CH = 3 };

struct event {
  uint32_t next_free; /* index + 1 of the next free event; 0 ends the list */
  uint32_t gen;       /* bumped at each allocation */
  uint8_t kind;
  union {
    struct {
      uint32_t tracker;
      uint8_t live; /* bit i: step[i] is started and not stopped */
      uint8_t wait[STEP_WINDOW];
      int32_t step[STEP_WINDOW];
      int64_t since[STEP_WINDOW]; /* when step[i] entered its current wait */
    } op;
    struct {
      uint32_t op, op_gen;
      int32_t step;
      uint64_t bytes; /* transSize of the step's latest state */
    } step;
    struct {
      uint32_t tracker;
      uint8_t traced;    /* its task is a traced op: its GPU times go on the op record */
      uint64_t index;    /* that op record's ring index */
      int64_t launch_ns; /* the task's host time, before the kernel started */
      uint64_t start;    /* GPU timer at the channel's start */
    } kernel;
  } u;
};

struct chan_key {
  uint64_t ticket; /* parent task; 0: a record of its own, never shared */
  const struct comm* comm;
  int32_t peer; /* comm-local */
  uint8_t channel, direction;
};

struct tracker {
  uint32_t lock; /* guards rec and the step state of the proxy ops using it */
  uint32_t refs; /* guarded by g_trk_lock */
  uint32_t next; /* hash chain or free list, index + 1 */
  uint32_t bucket;
  struct chan_key key;
  ccld_board* board; /* the board the record lives on */
  int32_t slot;
  ccld_channel rec; /* what we last wrote there */
  uint64_t wait_ns[4]; /* time its steps spent in each enum ccld_wait, for the link totals */
  uint32_t comm_gen;   /* of key.comm when acquired */
};

static struct comm g_comms[MAX_COMMS];
static struct task g_tasks[TASK_RING];
static uint64_t g_task_next;
static struct event g_events[EVENT_POOL];
static uint64_t g_ev_free;   /* (tag << 32) | (index + 1): the tag defeats ABA */
static uint32_t g_ev_unused; /* events below this index have been handed out once */
static struct tracker g_trk[MAX_TRACKERS];
static uint32_t g_trk_bucket[TRACKER_BUCKETS];
static uint32_t g_trk_free, g_trk_unused, g_trk_live, g_trk_lock;
static char g_group_handle; /* Group/GroupApi: NCCL skips children of a NULL handle */
static pid_t g_pid;
static ccld_nccl_logger_t g_log;
static uint32_t g_warned_comms, g_warned_events, g_warned_channels;
static ccld_nccl_stats_t g_stats;

static void warn_once(uint32_t* flag, const char* msg) {
  ccld_nccl_logger_t log = RLOAD(&g_log);
  if (log && !__atomic_exchange_n(flag, 1u, __ATOMIC_RELAXED))
    log(CCLD_NCCL_LOG_WARN, NCCL_LOG_SUBSYS_INIT, __FILE__, __LINE__, "%s", msg);
}

/* Our object behind a pointer NCCL hands back, or NULL if it is not one of ours. */
#define LOOKUP(table, p)                                                              \
  ((uintptr_t)(p) >= (uintptr_t)(table) &&                                            \
           (uintptr_t)(p) < (uintptr_t)(table) + sizeof(table) &&                    \
           ((uintptr_t)(p) - (uintptr_t)(table)) % sizeof((table)[0]) == 0            \
       ? &(table)[((uintptr_t)(p) - (uintptr_t)(table)) / sizeof((table)[0])]        \
       : NULL)

static struct comm* comm_of(void* ctx) {
  struct comm* c = LOOKUP(g_comms, ctx);
  return c && LOAD(&c->state) == COMM_LIVE ? c : NULL;
}

/* ---------------------------------------------------------------- peers */
static int32_t global_rank(const struct comm* c, ccld_board* b, int local) {
  if (!c || local < 0) return CCLD_NO_RANK;
  ccld_header* h = ccld_board_header(b);
  switch (LOAD(&c->map)) {
    case MAP_GROUP: {
      uint32_t slot = (uint32_t)RLOAD(&c->group_slot);
      if (slot >= LOAD(&h->num_groups)) return CCLD_NO_RANK;
      const ccld_group* g = ccld_board_group(b, slot);
      if (g->group_id != RLOAD(&c->group_id) || local >= g->size) return CCLD_NO_RANK;
      const int32_t* pool = (const int32_t*)((const char*)h + h->rank_pool_off);
      return pool[g->ranks_off + (uint32_t)local];
    }
    case MAP_PAIR:
      if (local == c->rank) return h->rank;
      return local == 1 - c->rank ? RLOAD(&c->pair_peer) : CCLD_NO_RANK;
    default:
      return CCLD_NO_RANK;
  }
}

/* Learn the comm's rank order from the group it was just bound to (see the top). */
static void bind_ranks(struct comm* c, ccld_board* b, uint64_t group_id, uint64_t op_index) {
  ccld_header* h = ccld_board_header(b);
  uint64_t n = LOAD(&h->num_groups);
  for (uint64_t i = 0; i < n; i++) {
    const ccld_group* g = ccld_board_group(b, (uint32_t)i);
    if (g->group_id != group_id) continue;
    if (g->size == c->nranks && g->my_index == c->rank) {
      RSTORE(&c->group_slot, (int32_t)i);
      STORE(&c->map, MAP_GROUP);
      return;
    }
    break;
  }
  if (c->nranks != 2 || (c->rank != 0 && c->rank != 1)) return;
  const ccld_op_record* ring = (const ccld_op_record*)((const char*)h + h->ring_off);
  ccld_op_record r;
  if (ccld_copy_records(&ring[op_index & (h->ring_size - 1)], &r, 1, sizeof r) != 1) return;
  if (r.index_lo != (uint32_t)op_index || !(r.flags & CCLD_FLAG_P2P) || r.peer < 0) return;
  RSTORE(&c->pair_peer, r.peer);
  STORE(&c->map, MAP_PAIR);
}

/* ---------------------------------------------------------------- tasks */
/* The calling thread's trace id for a Coll/P2p (or API event) of comm c. */
static void capture_trace(struct comm* c, ccld_board* b, struct task* t) {
  uint64_t gid, seq, index;
  uint64_t bound = LOAD(&c->group_id);
  t->group_id = bound;
  t->seq = 0;
  t->traced = 0;
  if (!ccld_current_trace(&gid, &seq, &index)) {
    COUNT(untraced);
    return;
  }
  if (bound == 0 &&
      __atomic_compare_exchange_n(&c->group_id, &bound, gid, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    bound = gid;
  /* A comm serves one group. A trace of another group is stale (the thread's previous op)
   * or belongs to a call we do not see; trusting it would mislabel every channel. */
  if (bound != gid) {
    t->group_id = bound;
    COUNT(trace_mismatch);
    return;
  }
  if (LOAD(&c->map) == MAP_NONE) bind_ranks(c, b, gid, index);
  t->group_id = gid;
  t->seq = seq;
  t->index = index;
  t->traced = 1;
  COUNT(traced);
}

static struct task* task_publish(const struct comm* c, uint8_t kind, const struct task* v) {
  uint64_t ticket = __atomic_add_fetch(&g_task_next, 1, __ATOMIC_RELAXED);
  struct task* t = &g_tasks[ticket & (TASK_RING - 1)];
  uint32_t l = RLOAD(&t->lock) & ~1u;
  RSTORE(&t->lock, l + 1);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  t->kind = kind;
  t->traced = v->traced;
  t->comm = c;
  t->comm_gen = RLOAD(&c->gen);
  t->ticket = ticket;
  t->group_id = v->group_id;
  t->seq = v->seq;
  t->index = v->index;
  t->host_ns = v->host_ns;
  STORE(&t->lock, l + 2);
  return t;
}

/* The task named as parent by a child event, if it is ours, of comm c, and readable. */
static int parent_task(const void* parent, const struct comm* c, struct task* out) {
  const struct task* t = LOOKUP(g_tasks, parent);
  if (!t || !c) return 0;
  for (int attempt = 0; attempt < 8; attempt++) {
    uint32_t l1 = LOAD(&t->lock);
    if (l1 & 1u) continue;
    memcpy(out, t, sizeof *out);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (RLOAD(&t->lock) == l1) return out->comm == c && out->comm_gen == RLOAD(&c->gen);
  }
  return 0;
}

static void* task_start(struct comm* c, uint8_t kind, const void* parent) {
  if (!c) return NULL;
  ccld_board* b = ccld_process_board();
  if (!b) {
    COUNT(no_board);
    return NULL;
  }
  struct task v = {0}, api;
  v.host_ns = ccld_now_ns();
  /* v5+: a Coll/P2p names its API event as parent; the trace was taken there. */
  if ((kind == TASK_COLL || kind == TASK_P2P) && parent_task(parent, c, &api) &&
      (api.kind == TASK_COLL_API || api.kind == TASK_P2P_API)) {
    v.group_id = api.group_id;
    v.seq = api.seq;
    v.index = api.index;
    v.traced = api.traced;
  } else {
    capture_trace(c, b, &v);
  }
  return task_publish(c, kind, &v);
}

/* ---------------------------------------------------------------- events */
static struct event* event_alloc(uint8_t kind) {
  struct event* e = NULL;
  uint64_t head = LOAD(&g_ev_free);
  while ((uint32_t)head != 0) {
    struct event* top = &g_events[(uint32_t)head - 1];
    uint64_t next = (((head >> 32) + 1) << 32) | RLOAD(&top->next_free);
    if (__atomic_compare_exchange_n(&g_ev_free, &head, next, 1, __ATOMIC_ACQUIRE,
                                    __ATOMIC_ACQUIRE)) {
      e = top;
      break;
    }
  }
  if (!e && RLOAD(&g_ev_unused) < EVENT_POOL) {
    uint32_t i = __atomic_fetch_add(&g_ev_unused, 1u, __ATOMIC_RELAXED);
    if (i < EVENT_POOL) e = &g_events[i];
  }
  if (!e) {
    warn_once(&g_warned_events, "ccld: NCCL profiler event pool exhausted; some channel "
                                "progress is not recorded");
    return NULL;
  }
  memset(&e->u, 0, sizeof e->u);
  RSTORE(&e->gen, RLOAD(&e->gen) + 1);
  RSTORE(&e->kind, kind);
  return e;
}

static void event_free(struct event* e) {
  RSTORE(&e->kind, (uint8_t)EV_FREE);
  uint64_t self = (uint64_t)(e - g_events) + 1;
  uint64_t head = RLOAD(&g_ev_free);
  do {
    RSTORE(&e->next_free, (uint32_t)head);
  } while (!__atomic_compare_exchange_n(&g_ev_free, &head, (((head >> 32) + 1) << 32) | self, 1,
                                        __ATOMIC_RELEASE, __ATOMIC_RELAXED));
}

static struct event* event_of(void* h) {
  struct event* e = LOOKUP(g_events, h);
  return e && RLOAD(&e->kind) != EV_FREE ? e : NULL;
}

/* ---------------------------------------------------------------- channel records */
static int same_key(const struct chan_key* a, const struct chan_key* b) {
  return a->ticket == b->ticket && a->comm == b->comm && a->peer == b->peer &&
         a->channel == b->channel && a->direction == b->direction;
}

static uint32_t key_bucket(const struct chan_key* k) {
  uint64_t h = k->ticket * 0x9E3779B97F4A7C15ull;
  h ^= ((uint64_t)k->channel << 48) ^ ((uint64_t)(uint32_t)k->peer << 8) ^ k->direction;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  return (uint32_t)(h >> 40) & (TRACKER_BUCKETS - 1);
}

/* The tracker of key k: shared when k->ticket is set and one exists, else a new one with
 * a freshly claimed board record holding `fresh`. NULL when a table is full. */
static struct tracker* tracker_acquire(ccld_board* b, const struct chan_key* k,
                                       const ccld_channel* fresh) {
  uint32_t bucket = key_bucket(k);
  ccld_spin_lock(&g_trk_lock);
  if (k->ticket) {
    for (uint32_t i = g_trk_bucket[bucket]; i; i = g_trk[i - 1].next) {
      struct tracker* t = &g_trk[i - 1];
      if (t->board == b && same_key(&t->key, k)) {
        t->refs++;
        ccld_spin_unlock(&g_trk_lock);
        return t;
      }
    }
  }
  struct tracker* t = NULL;
  if (g_trk_free) {
    t = &g_trk[g_trk_free - 1];
    g_trk_free = t->next;
  } else if (g_trk_unused < MAX_TRACKERS) {
    t = &g_trk[g_trk_unused++];
  }
  int32_t slot = t ? ccld_channel_claim(b, CCLD_SRC_NCCL) : -1;
  if (slot < 0) {
    if (t) {
      t->next = g_trk_free;
      g_trk_free = (uint32_t)(t - g_trk) + 1;
    }
    ccld_spin_unlock(&g_trk_lock);
    return NULL;
  }
  t->key = *k;
  t->refs = 1;
  t->board = b;
  t->slot = slot;
  t->rec = *fresh;
  memset(t->wait_ns, 0, sizeof t->wait_ns);
  t->comm_gen = k->comm ? LOAD(&k->comm->gen) : 0;
  t->bucket = bucket;
  t->next = 0;
  if (k->ticket) {
    t->next = g_trk_bucket[bucket];
    g_trk_bucket[bucket] = (uint32_t)(t - g_trk) + 1;
  }
  g_trk_live++;
  /* Nobody else can reach t before we unlock the table: no need for t->lock here. */
  ccld_channel_write(b, slot, &t->rec);
  ccld_spin_unlock(&g_trk_lock);
  return t;
}

static void tracker_release(struct tracker* t) {
  ccld_spin_lock(&g_trk_lock);
  if (--t->refs == 0) {
    if (t->key.ticket) {
      uint32_t self = (uint32_t)(t - g_trk) + 1;
      uint32_t* link = &g_trk_bucket[t->bucket];
      while (*link && *link != self) link = &g_trk[*link - 1].next;
      if (*link) *link = t->next;
    }
    /* The board may have been closed (or replaced) since: then the slot is not ours. */
    if (ccld_process_board() == t->board) {
      ccld_channel_release(t->board, t->slot); /* first: the totals may need a slot */
      if (t->key.comm && t->rec.peer != CCLD_NO_RANK &&
          ccld_link_add(t->board, t->key.comm, t->comm_gen, t->key.peer, &t->rec,
                        t->wait_ns) != 0)
        COUNT(dropped);
    }
    t->next = g_trk_free;
    g_trk_free = (uint32_t)(t - g_trk) + 1;
    g_trk_live--;
  }
  ccld_spin_unlock(&g_trk_lock);
}

/* Write t->rec to the board; the caller holds t->lock. */
static void tracker_publish(struct tracker* t, int64_t now) {
  t->rec.last_progress_ns = now;
  if (ccld_process_board() == t->board) ccld_channel_write(t->board, t->slot, &t->rec);
}

/* A channel is in the wait state of its oldest live step: later steps queue behind it. */
static uint8_t oldest_wait(const struct event* op) {
  uint8_t wait = CCLD_WAIT_NONE;
  int32_t oldest = 0;
  int have = 0;
  for (unsigned i = 0; i < STEP_WINDOW; i++) {
    if (!(op->u.op.live & (1u << i))) continue;
    int32_t s = op->u.op.step[i];
    if (!have || (int32_t)((uint32_t)s - (uint32_t)oldest) < 0) {
      oldest = s;
      wait = op->u.op.wait[i];
      have = 1;
    }
  }
  return wait;
}

/* What a step state says the step waits for; 0xff for states that are not step waits. */
static uint8_t wait_of_state(int state) {
  switch (state) {
    case CCLD_NCCL_STATE_SEND_GPU_WAIT:
    case CCLD_NCCL_STATE_RECV_GPU_WAIT:
    case CCLD_NCCL_STATE_RECV_FLUSH_WAIT: /* the local NIC/GPU flush of received data */
      return CCLD_WAIT_LOCAL;
    case CCLD_NCCL_STATE_SEND_PEER_WAIT:
      return CCLD_WAIT_PEER;
    case CCLD_NCCL_STATE_SEND_WAIT:
    case CCLD_NCCL_STATE_RECV_WAIT:
      return CCLD_WAIT_NETWORK;
    default:
      return 0xff;
  }
}

/* No record for this event (a table is full): counted, logged once, and a NULL handle. */
static void* drop_channel(ccld_board* b) {
  COUNT(dropped);
  ccld_count_error(b);
  warn_once(&g_warned_channels, "ccld: board channel table (or the plugin's tracker table) "
                                "is full; some channel progress is not recorded");
  return NULL;
}

/* ---------------------------------------------------------------- proxy and kernel events */
/* The tracker (and board record) of a proxy op or kernel channel event e: a new record
 * for key k, or the shared one of its task. NULL, with e freed, when a table is full. */
static struct tracker* track(ccld_board* b, const struct chan_key* k, struct event* e,
                             int32_t peer, uint32_t pid, uint64_t group_id, uint64_t seq) {
  int64_t now = ccld_now_ns();
  ccld_channel fresh = {
      .source = CCLD_SRC_NCCL,
      .direction = k->direction,
      .wait = CCLD_WAIT_NONE,
      .channel_id = k->channel,
      .peer = peer,
      .pid = pid,
      .group_id = group_id,
      .seq = seq,
      .first_ns = now,
      .last_progress_ns = now,
  };
  struct tracker* t = tracker_acquire(b, k, &fresh);
  if (!t) event_free(e);
  return t;
}

static void* proxy_op_start(struct comm* c, const void* parent,
                            const struct ccld_nccl_proxy_op* d) {
  ccld_board* b = ccld_process_board();
  if (!b) {
    COUNT(no_board);
    return NULL;
  }
  struct chan_key k = {0, c, d->peer, d->channelId, d->isSend ? CCLD_DIR_SEND : CCLD_DIR_RECV};
  uint64_t group_id = c ? LOAD(&c->group_id) : 0, seq = 0;
  struct task p;
  if (d->pid != RLOAD(&g_pid)) {
    COUNT(foreign_ops); /* PXN: parentObj lives in another process; seq stays unknown */
  } else if (parent_task(parent, c, &p)) {
    k.ticket = p.ticket;
    group_id = p.group_id;
    seq = p.seq;
  }
  struct event* e = event_alloc(EV_PROXY_OP);
  if (!e) {
    COUNT(dropped);
    return NULL;
  }
  struct tracker* t = track(b, &k, e, global_rank(c, b, d->peer), (uint32_t)d->pid, group_id,
                            seq);
  if (!t) return drop_channel(b);
  e->u.op.tracker = (uint32_t)(t - g_trk);
  return e;
}

static void proxy_op_state(struct event* e, int state) {
  if (state != CCLD_NCCL_STATE_PROXY_OP_IN_PROGRESS) return;
  struct tracker* t = &g_trk[e->u.op.tracker];
  ccld_spin_lock(&t->lock);
  tracker_publish(t, ccld_now_ns());
  ccld_spin_unlock(&t->lock);
}

static void proxy_op_stop(struct event* e) {
  tracker_release(&g_trk[e->u.op.tracker]);
  event_free(e);
}

static void* proxy_step_start(void* parent, int step) {
  struct event* op = event_of(parent);
  if (!op || RLOAD(&op->kind) != EV_PROXY_OP) return NULL;
  struct event* e = event_alloc(EV_PROXY_STEP);
  if (!e) {
    COUNT(dropped);
    return NULL;
  }
  e->u.step.op = (uint32_t)(op - g_events);
  e->u.step.op_gen = RLOAD(&op->gen);
  e->u.step.step = step;
  unsigned i = (uint32_t)step % STEP_WINDOW;
  struct tracker* t = &g_trk[op->u.op.tracker];
  int64_t now = ccld_now_ns();
  ccld_spin_lock(&t->lock);
  op->u.op.step[i] = step;
  op->u.op.wait[i] = CCLD_WAIT_NONE;
  op->u.op.since[i] = now;
  op->u.op.live |= (uint8_t)(1u << i);
  t->rec.steps_posted++;
  t->rec.wait = oldest_wait(op);
  tracker_publish(t, now);
  ccld_spin_unlock(&t->lock);
  return e;
}

/* The proxy op of a step, unless it was stopped (and maybe reused) before the step. */
static struct event* step_op(const struct event* e) {
  struct event* op = &g_events[e->u.step.op];
  return RLOAD(&op->kind) == EV_PROXY_OP && RLOAD(&op->gen) == e->u.step.op_gen ? op : NULL;
}

static void proxy_step_update(struct event* e, uint8_t wait, int stopped) {
  struct event* op = step_op(e);
  if (!op) return;
  unsigned i = (uint32_t)e->u.step.step % STEP_WINDOW;
  uint8_t bit = (uint8_t)(1u << i);
  struct tracker* t = &g_trk[op->u.op.tracker];
  int64_t now = ccld_now_ns();
  ccld_spin_lock(&t->lock);
  int mine = (op->u.op.live & bit) && op->u.op.step[i] == e->u.step.step;
  if (mine) { /* the time it spent in the wait it leaves */
    t->wait_ns[op->u.op.wait[i] & 3u] += (uint64_t)(now - op->u.op.since[i]);
    op->u.op.since[i] = now;
  }
  if (mine && stopped) {
    op->u.op.live &= (uint8_t)~bit;
    t->rec.steps_done++;
    t->rec.bytes_done += e->u.step.bytes;
  } else if (mine) {
    op->u.op.wait[i] = wait;
  }
  t->rec.wait = oldest_wait(op);
  tracker_publish(t, now);
  ccld_spin_unlock(&t->lock);
}

static void* kernel_ch_start(struct comm* c, const void* parent,
                             const struct ccld_nccl_kernel_ch* d) {
  ccld_board* b = ccld_process_board();
  if (!b) {
    COUNT(no_board);
    return NULL;
  }
  struct task p;
  uint64_t group_id = c ? LOAD(&c->group_id) : 0, seq = 0;
  int traced = parent_task(parent, c, &p);
  if (traced) {
    group_id = p.group_id;
    seq = p.seq;
  }
  struct event* e = event_alloc(EV_KERNEL_CH);
  if (!e) {
    COUNT(dropped);
    return NULL;
  }
  struct chan_key k = {0, c, CCLD_NO_RANK, d->channelId, CCLD_DIR_SEND};
  struct tracker* t = track(b, &k, e, CCLD_NO_RANK, (uint32_t)RLOAD(&g_pid), group_id, seq);
  if (!t) return drop_channel(b);
  e->u.kernel.tracker = (uint32_t)(t - g_trk);
  e->u.kernel.traced = (uint8_t)(traced && p.traced);
  e->u.kernel.index = traced ? p.index : 0;
  e->u.kernel.launch_ns = traced ? p.host_ns : 0;
  e->u.kernel.start = d->pTimer;
  return e;
}

/* ---------------------------------------------------------------- the GPU clock
 * The kernel stamps each channel's start and stop with the GPU's global timer (ns, its
 * own epoch). Each KernelCh bounds the offset GPU timer - host monotonic clock: the start
 * came after the host raised the op (offset <= start - launch), the stop before the
 * proxy saw it (offset >= stop - now). The tightest bounds of the last two windows of
 * GPU_WINDOW kernels (older ones are let go: the two clocks drift) give the offset, their
 * middle, and its error, half their gap. Bounds that contradict the window by more than
 * GPU_JUMP_NS say the timer jumped: the windows start again. */
#define GPU_WINDOW 128
#define GPU_JUMP_NS 1000000LL
struct bounds {
  int64_t lo, hi;
};
static const struct bounds NO_BOUNDS = {INT64_MIN, INT64_MAX};
static struct {
  uint32_t lock;
  uint32_t count; /* kernels in the current window */
  struct bounds now, before;
} g_gpu = {0, 0, {INT64_MIN, INT64_MAX}, {INT64_MIN, INT64_MAX}};

static struct bounds tighter(struct bounds a, struct bounds b) {
  return (struct bounds){a.lo > b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi};
}

static int known(struct bounds b) { return b.lo != INT64_MIN && b.hi != INT64_MAX && b.hi >= b.lo; }

static int gpu_offset(struct bounds k, int64_t* offset, int64_t* err) {
  ccld_spin_lock(&g_gpu.lock);
  struct bounds both = tighter(g_gpu.now, g_gpu.before);
  if (known(both) && (k.lo > both.hi + GPU_JUMP_NS || k.hi < both.lo - GPU_JUMP_NS)) {
    g_gpu.now = g_gpu.before = NO_BOUNDS;
    g_gpu.count = 0;
  }
  g_gpu.now = tighter(g_gpu.now, k);
  if (++g_gpu.count >= GPU_WINDOW) {
    g_gpu.before = g_gpu.now;
    g_gpu.now = NO_BOUNDS;
    g_gpu.count = 0;
  }
  both = tighter(g_gpu.now, g_gpu.before);
  if (!known(both)) both = known(g_gpu.now) ? g_gpu.now : g_gpu.before; /* drifted apart */
  ccld_spin_unlock(&g_gpu.lock);
  if (!known(both)) return 0;
  *offset = both.lo + (both.hi - both.lo) / 2;
  *err = (both.hi - both.lo) / 2;
  return 1;
}

static void kernel_ch_state(struct event* e, int state, const ccld_nccl_state_args_t* args) {
  if (state != CCLD_NCCL_STATE_KERNEL_CH_STOP) return;
  struct tracker* t = &g_trk[e->u.kernel.tracker];
  int64_t now = ccld_now_ns();
  ccld_spin_lock(&t->lock);
  tracker_publish(t, now);
  ccld_spin_unlock(&t->lock);
  uint64_t start = e->u.kernel.start, stop = args ? args->kernelCh.pTimer : 0;
  if (!start || stop < start || !e->u.kernel.launch_ns) return; /* NCCL < 2.27: no timer */
  int64_t offset, err;
  struct bounds k = {(int64_t)stop - now, (int64_t)start - e->u.kernel.launch_ns};
  if (!gpu_offset(k, &offset, &err)) return;
  ccld_board* b = ccld_process_board();
  if (b && e->u.kernel.traced)
    ccld_op_set_device(b, e->u.kernel.index, CCLD_TIME_PROFILER, (int64_t)start - offset,
                       (int64_t)stop - offset, err > UINT32_MAX ? UINT32_MAX : (uint32_t)err);
}

static void kernel_ch_stop(struct event* e) {
  tracker_release(&g_trk[e->u.kernel.tracker]);
  event_free(e);
}

/* ---------------------------------------------------------------- the interface */
static ccld_nccl_result_t init_comm(void** context, int* mask, uint64_t comm_id,
                                    const char* name, int nranks, int rank,
                                    ccld_nccl_logger_t log, int version) {
  if (!context || !mask) return CCLD_NCCL_INVALID_ARGUMENT;
  *context = NULL;
  RSTORE(&g_pid, getpid());
  if (log) {
    ccld_nccl_logger_t none = NULL;
    __atomic_compare_exchange_n(&g_log, &none, log, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
  /* NCCL keeps one activation mask for all comms: never write 0 here, even for a comm we
   * cannot track; a NULL context makes its events untracked instead. */
  *mask = version >= 5 ? MASK_V5 : MASK_V4;
  struct comm* c = NULL;
  for (uint32_t i = 0; i < MAX_COMMS && !c; i++) {
    uint32_t free_state = COMM_FREE;
    if (__atomic_compare_exchange_n(&g_comms[i].state, &free_state, COMM_CLAIMED, 0,
                                    __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      c = &g_comms[i];
  }
  if (!c) {
    warn_once(&g_warned_comms, "ccld: too many communicators; channel progress of the "
                               "newest ones is not recorded");
    return CCLD_NCCL_SUCCESS;
  }
  c->rank = rank;
  c->nranks = nranks;
  c->comm_id = comm_id;
  RSTORE(&c->map, MAP_NONE);
  RSTORE(&c->group_id, 0);
  STORE(&c->state, COMM_LIVE);
  COUNT(comms);
  if (log)
    log(CCLD_NCCL_LOG_INFO, NCCL_LOG_SUBSYS_INIT, __FILE__, __LINE__,
        "ccld: profiler v%d attached to comm %s (id %llx, rank %d of %d)", version,
        name ? name : "", (unsigned long long)comm_id, rank, nranks);
  *context = c;
  return CCLD_NCCL_SUCCESS;
}

static void* start_event(void* ctx, uint64_t type, void* parent, const descr_body* d,
                         int version) {
  struct comm* c = comm_of(ctx);
  switch (type) {
    case CCLD_NCCL_EV_GROUP:
    case CCLD_NCCL_EV_GROUP_API:
      return c && ccld_process_board() ? &g_group_handle : NULL;
    case CCLD_NCCL_EV_COLL:
      return task_start(c, TASK_COLL, version >= 5 ? parent : NULL);
    case CCLD_NCCL_EV_P2P:
      return task_start(c, TASK_P2P, version >= 5 ? parent : NULL);
    case CCLD_NCCL_EV_COLL_API:
      return version >= 5 ? task_start(c, TASK_COLL_API, NULL) : NULL;
    case CCLD_NCCL_EV_P2P_API:
      return version >= 5 ? task_start(c, TASK_P2P_API, NULL) : NULL;
    case CCLD_NCCL_EV_PROXY_OP:
      return proxy_op_start(c, parent, &d->proxyOp);
    case CCLD_NCCL_EV_PROXY_STEP:
      return proxy_step_start(parent, d->proxyStep.step);
    case CCLD_NCCL_EV_KERNEL_CH:
      return kernel_ch_start(c, parent, &d->kernelCh);
    default:
      return NULL; /* ProxyCtrl, NetPlugin, KernelLaunch, copy-engine events */
  }
}

static ccld_nccl_result_t init_v4(void** context, int* mask, const char* name, uint64_t hash,
                                  int nnodes, int nranks, int rank, ccld_nccl_logger_t log) {
  (void)nnodes;
  return init_comm(context, mask, hash, name, nranks, rank, log, 4);
}

static ccld_nccl_result_t init_v5(void** context, uint64_t id, int* mask, const char* name,
                                  int nnodes, int nranks, int rank, ccld_nccl_logger_t log) {
  (void)nnodes;
  return init_comm(context, mask, id, name, nranks, rank, log, 5);
}

static ccld_nccl_result_t init_v6(void** context, uint64_t id, int* mask, const char* name,
                                  int nnodes, int nranks, int rank, ccld_nccl_logger_t log) {
  (void)nnodes;
  return init_comm(context, mask, id, name, nranks, rank, log, 6);
}

static ccld_nccl_result_t start_v4(void* ctx, void** eh, ccld_nccl_descr_v4_t* d) {
  if (eh) *eh = d ? start_event(ctx, d->type, d->parentObj, BODY(d), 4) : NULL;
  return CCLD_NCCL_SUCCESS;
}

static ccld_nccl_result_t start_v5(void* ctx, void** eh, ccld_nccl_descr_v5_t* d) {
  if (eh) *eh = d ? start_event(ctx, d->type, d->parentObj, BODY(d), 5) : NULL;
  return CCLD_NCCL_SUCCESS;
}

static ccld_nccl_result_t start_v6(void* ctx, void** eh, ccld_nccl_descr_v6_t* d) {
  if (eh) *eh = d ? start_event(ctx, d->type, d->parentObj, BODY(d), 6) : NULL;
  return CCLD_NCCL_SUCCESS;
}

/* stopEvent, recordEventState and finalize have one signature in every version. */
static ccld_nccl_result_t stop_event(void* handle) {
  struct event* e = event_of(handle);
  if (!e) return CCLD_NCCL_SUCCESS; /* tasks, the group handle, NULL, or not ours */
  switch (RLOAD(&e->kind)) {
    case EV_PROXY_OP:
      proxy_op_stop(e);
      break;
    case EV_PROXY_STEP:
      proxy_step_update(e, CCLD_WAIT_NONE, 1);
      event_free(e);
      break;
    case EV_KERNEL_CH:
      kernel_ch_stop(e);
      break;
  }
  return CCLD_NCCL_SUCCESS;
}

static ccld_nccl_result_t record_state(void* handle, int state, ccld_nccl_state_args_t* args) {
  struct event* e = event_of(handle);
  if (!e) return CCLD_NCCL_SUCCESS;
  switch (RLOAD(&e->kind)) {
    case EV_PROXY_OP:
      proxy_op_state(e, state);
      break;
    case EV_PROXY_STEP: {
      uint8_t wait = wait_of_state(state);
      if (wait == 0xff) break;
      /* The latest state's transSize is the step's size: sends learn it when posted,
       * receives when the data has arrived. */
      if (args && args->proxyStep.transSize) e->u.step.bytes = args->proxyStep.transSize;
      proxy_step_update(e, wait, 0);
      break;
    }
    case EV_KERNEL_CH:
      kernel_ch_state(e, state, args);
      break;
  }
  return CCLD_NCCL_SUCCESS;
}

/* A comm finalized with ops in flight (ncclCommAbort) never stops their events: take
 * their records off the board so that they do not read as stuck channels. The trackers
 * stay allocated, detached from the board, in case a stop still arrives. */
static void detach_comm_records(const struct comm* c) {
  ccld_spin_lock(&g_trk_lock);
  for (uint32_t i = 0; i < g_trk_unused; i++) {
    struct tracker* t = &g_trk[i];
    if (!t->refs || t->key.comm != c || !t->board) continue;
    ccld_spin_lock(&t->lock);
    if (ccld_process_board() == t->board) ccld_channel_release(t->board, t->slot);
    t->board = NULL;
    ccld_spin_unlock(&t->lock);
  }
  ccld_spin_unlock(&g_trk_lock);
}

static ccld_nccl_result_t finalize_comm(void* ctx) {
  struct comm* c = comm_of(ctx);
  if (c) {
    detach_comm_records(c);
    ccld_link_drop_comm(c);
    __atomic_add_fetch(&c->gen, 1u, __ATOMIC_RELEASE);
    STORE(&c->state, COMM_FREE);
  }
  return CCLD_NCCL_SUCCESS;
}

const ccld_nccl_profiler_v4_t ncclProfiler_v4 = {"ccld", init_v4, start_v4, stop_event,
                                                 record_state, finalize_comm};
const ccld_nccl_profiler_v5_t ncclProfiler_v5 = {"ccld", init_v5, start_v5, stop_event,
                                                 record_state, finalize_comm};
const ccld_nccl_profiler_v6_t ncclProfiler_v6 = {"ccld", init_v6, start_v6, stop_event,
                                                 record_state, finalize_comm};

/* ---------------------------------------------------------------- introspection */
void ccld_nccl_stats(ccld_nccl_stats_t* out) {
  if (!out) return;
  const uint64_t* src = (const uint64_t*)&g_stats;
  uint64_t* dst = (uint64_t*)out;
  for (size_t i = 0; i < sizeof *out / sizeof(uint64_t); i++) dst[i] = RLOAD(&src[i]);
  uint64_t live = 0;
  uint32_t used = RLOAD(&g_ev_unused);
  for (uint32_t i = 0; i < used && i < EVENT_POOL; i++) live += RLOAD(&g_events[i].kind) != EV_FREE;
  out->live_events = live;
  out->live_channels = RLOAD(&g_trk_live);
}

void ccld_nccl_stats_reset(void) {
  uint64_t* p = (uint64_t*)&g_stats;
  for (size_t i = 0; i < sizeof g_stats / sizeof(uint64_t); i++) RSTORE(&p[i], 0);
}

int ccld_nccl_comm_group(uint64_t comm_id, uint64_t* group_id) {
  for (uint32_t i = 0; i < MAX_COMMS; i++) {
    const struct comm* c = &g_comms[i];
    if (LOAD(&c->state) != COMM_LIVE || c->comm_id != comm_id) continue;
    uint64_t g = LOAD(&c->group_id);
    if (!g) return 0;
    if (group_id) *group_id = g;
    return 1;
  }
  return 0;
}

int ccld_nccl_comms(uint64_t* comm_ids, uint64_t* group_ids, int max) {
  int n = 0;
  for (uint32_t i = 0; i < MAX_COMMS; i++) {
    const struct comm* c = &g_comms[i];
    if (LOAD(&c->state) != COMM_LIVE) continue;
    if (n < max && comm_ids) comm_ids[n] = c->comm_id;
    if (n < max && group_ids) group_ids[n] = LOAD(&c->group_id);
    n++;
  }
  return n;
}
