/* Interface harness for the ccld NCCL profiler plugin. This is not NCCL and needs no GPU:
 * it loads the plugin library the way NCCL does (dlopen by path, newest ncclProfiler_vN
 * symbol first) and replays event streams shaped like NCCL's (caller thread: Group, API,
 * Coll/P2p; proxy thread: ProxyOp, ProxyStep, KernelCh) so that tests can check what the
 * plugin writes to the board. Board functions are looked up in the same library, so the
 * board created here is the plugin's process board.
 *
 * usage: nccl_harness LIB VERSION SCENARIO BOARD [ARG]
 *   VERSION   4, 5, 6, or 0 for the newest the library exports
 *   SCENARIO  ring RANK | ringfault RANK FAULT WHERE | p2p SIDE | edge | threads | bench |
 *             abort | noboard | layout
 * Built with -DCCLD_HARNESS_LIB it is a library for live jobs instead (ccld_harness_ring).
 * Prints one JSON object on stdout; exits non-zero only when the harness itself fails.
 * Boards are left mapped at exit, as a killed rank would leave them: tests read the file.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "board.h"
#include "nccl_profiler_abi.h"

/* ------------------------------------------------------------------ loading */
static int g_version;
static const void* g_sym;
static int g_bad_returns, g_unwritten_handles, g_warnings;

#define SYM(name) static __typeof__(name)* p_##name
SYM(ccld_board_create);
SYM(ccld_board_header);
SYM(ccld_board_channels);
SYM(ccld_group_register);
SYM(ccld_op_enter);
SYM(ccld_op_exit);
SYM(ccld_clear_current_trace);
SYM(ccld_copy_records);
SYM(ccld_now_ns);
SYM(ccld_nccl_stats);
SYM(ccld_nccl_comm_group);
SYM(ccld_nccl_comms);

static void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  exit(2);
}

static void* resolve(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (!p) die("harness: %s not exported: %s\n", name, dlerror());
  return p;
}

static void load(const char* path, int want) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) die("harness: dlopen %s: %s\n", path, dlerror());
  static const char* names[] = {"ncclProfiler_v6", "ncclProfiler_v5", "ncclProfiler_v4"};
  for (int i = 0; i < 3 && !g_sym; i++) {
    if (want && want != 6 - i) continue;
    g_sym = dlsym(lib, names[i]);
    g_version = 6 - i;
  }
  if (!g_sym) die("harness: no ncclProfiler symbol for version %d\n", want);
#define RESOLVE(name) p_##name = (__typeof__(name)*)resolve(lib, #name)
  RESOLVE(ccld_board_create);
  RESOLVE(ccld_board_header);
  RESOLVE(ccld_board_channels);
  RESOLVE(ccld_group_register);
  RESOLVE(ccld_op_enter);
  RESOLVE(ccld_op_exit);
  RESOLVE(ccld_clear_current_trace);
  RESOLVE(ccld_copy_records);
  RESOLVE(ccld_now_ns);
  RESOLVE(ccld_nccl_stats);
  RESOLVE(ccld_nccl_comm_group);
  RESOLVE(ccld_nccl_comms);
}

#define V4 ((const ccld_nccl_profiler_v4_t*)g_sym)
#define V5 ((const ccld_nccl_profiler_v5_t*)g_sym)
#define V6 ((const ccld_nccl_profiler_v6_t*)g_sym)
#define CHECK(call)                                                      \
  do {                                                                   \
    if ((call) != CCLD_NCCL_SUCCESS) __atomic_add_fetch(&g_bad_returns, 1, __ATOMIC_RELAXED); \
  } while (0)

static void logger(int level, unsigned long flags, const char* file, int line, const char* fmt,
                   ...) {
  (void)flags;
  if (level == CCLD_NCCL_LOG_WARN) __atomic_add_fetch(&g_warnings, 1, __ATOMIC_RELAXED);
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[nccl log %d %s:%d] ", level, file, line);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* ------------------------------------------------------------------ the interface */
static void* nccl_init(uint64_t id, int nranks, int rank, int* mask) {
  void* ctx = NULL;
  int m = 0;
  switch (g_version) {
    case 4: CHECK(V4->init(&ctx, &m, "harness", id, 1, nranks, rank, logger)); break;
    case 5: CHECK(V5->init(&ctx, id, &m, "harness", 1, nranks, rank, logger)); break;
    default: CHECK(V6->init(&ctx, id, &m, "harness", 1, nranks, rank, logger)); break;
  }
  if (mask) *mask = m;
  return ctx;
}

/* What a test wants in a descriptor; ev_start builds the version's own struct from it. */
struct ev {
  uint64_t type;
  void* parent;
  int rank;
  struct ccld_nccl_proxy_op op;
  int step;
  struct ccld_nccl_kernel_ch kch;
  int peer;
  uint8_t nchannels;
};

#define FILL(d, e)                                                   \
  do {                                                               \
    memset(&(d), 0, sizeof(d));                                      \
    (d).type = (e)->type;                                            \
    (d).parentObj = (e)->parent;                                     \
    (d).rank = (e)->rank;                                            \
    switch ((e)->type) {                                             \
      case CCLD_NCCL_EV_COLL:                                        \
        (d).coll.func = "AllReduce";                                 \
        (d).coll.datatype = "ncclFloat32";                           \
        (d).coll.nChannels = (e)->nchannels;                         \
        (d).coll.algo = "RING";                                      \
        (d).coll.proto = "SIMPLE";                                   \
        break;                                                       \
      case CCLD_NCCL_EV_P2P:                                         \
        (d).p2p.func = "Send";                                       \
        (d).p2p.peer = (e)->peer;                                    \
        (d).p2p.nChannels = (e)->nchannels;                          \
        break;                                                       \
      case CCLD_NCCL_EV_PROXY_OP: (d).proxyOp = (e)->op; break;      \
      case CCLD_NCCL_EV_PROXY_STEP: (d).proxyStep.step = (e)->step; break; \
      case CCLD_NCCL_EV_KERNEL_CH: (d).kernelCh = (e)->kch; break;   \
    }                                                                \
  } while (0)

static void* ev_start(void* ctx, const struct ev* e) {
  static char poison;
  void* h = &poison; /* the plugin must always write *eHandle */
  switch (g_version) {
    case 4: {
      ccld_nccl_descr_v4_t d;
      FILL(d, e);
      CHECK(V4->startEvent(ctx, &h, &d));
      break;
    }
    case 5: {
      ccld_nccl_descr_v5_t d;
      FILL(d, e);
      CHECK(V5->startEvent(ctx, &h, &d));
      break;
    }
    default: {
      ccld_nccl_descr_v6_t d;
      FILL(d, e);
      CHECK(V6->startEvent(ctx, &h, &d));
      break;
    }
  }
  if (h == &poison) {
    __atomic_add_fetch(&g_unwritten_handles, 1, __ATOMIC_RELAXED);
    h = NULL;
  }
  return h;
}

/* NCCL never calls stop/record with a NULL handle; the harness does the same. */
static void ev_stop(void* h) {
  if (!h) return;
  switch (g_version) {
    case 4: CHECK(V4->stopEvent(h)); break;
    case 5: CHECK(V5->stopEvent(h)); break;
    default: CHECK(V6->stopEvent(h)); break;
  }
}

static void ev_state(void* h, int state, uint64_t arg) {
  if (!h) return;
  ccld_nccl_state_args_t a;
  memset(&a, 0, sizeof a);
  a.proxyStep.transSize = (size_t)arg; /* or kernelCh.pTimer: same 8 bytes */
  switch (g_version) {
    case 4: CHECK(V4->recordEventState(h, state, &a)); break;
    case 5: CHECK(V5->recordEventState(h, state, &a)); break;
    default: CHECK(V6->recordEventState(h, state, &a)); break;
  }
}

static void nccl_finalize(void* ctx) {
  switch (g_version) {
    case 4: CHECK(V4->finalize(ctx)); break;
    case 5: CHECK(V5->finalize(ctx)); break;
    default: CHECK(V6->finalize(ctx)); break;
  }
}

/* ------------------------------------------------------------------ NCCL-shaped streams */
/* One collective or p2p on the caller's thread, inside the NCCL call; returns the task
 * handle that NCCL then hands to proxy ops and kernel channels as their parent (after it
 * has already stopped the task: stop means "enqueued"). */
static void* nccl_task(void* ctx, int p2p, int peer, uint8_t nchannels) {
  void *gapi = NULL, *api = NULL;
  if (g_version >= 5) {
    gapi = ev_start(ctx, &(struct ev){.type = CCLD_NCCL_EV_GROUP_API});
    api = ev_start(ctx, &(struct ev){.type = p2p ? CCLD_NCCL_EV_P2P_API : CCLD_NCCL_EV_COLL_API,
                                     .parent = gapi});
    ev_stop(api); /* the API call returns before the group launches */
  }
  void* group = ev_start(ctx, &(struct ev){.type = CCLD_NCCL_EV_GROUP});
  void* task = ev_start(ctx, &(struct ev){.type = p2p ? CCLD_NCCL_EV_P2P : CCLD_NCCL_EV_COLL,
                                          .parent = g_version >= 5 ? api : group,
                                          .peer = peer,
                                          .nchannels = nchannels});
  ev_stop(task);
  ev_stop(group);
  ev_stop(gapi);
  return task;
}

static void* proxy_op(void* ctx, void* parent, pid_t pid, int ch, int peer, int nsteps,
                      int chunk, int is_send) {
  struct ev e = {.type = CCLD_NCCL_EV_PROXY_OP, .parent = parent};
  e.op.pid = pid;
  e.op.channelId = (uint8_t)ch;
  e.op.peer = peer;
  e.op.nSteps = nsteps;
  e.op.chunkSize = chunk;
  e.op.isSend = is_send;
  void* h = ev_start(ctx, &e);
  ev_state(h, CCLD_NCCL_STATE_PROXY_OP_IN_PROGRESS, 0);
  return h;
}

static void* kernel_ch(void* ctx, void* parent, int ch) {
  struct ev e = {.type = CCLD_NCCL_EV_KERNEL_CH, .parent = parent};
  e.kch.channelId = (uint8_t)ch;
  e.kch.pTimer = 1000;
  return ev_start(ctx, &e);
}

static void kernel_ch_done(void* h) {
  ev_state(h, CCLD_NCCL_STATE_KERNEL_CH_STOP, 2000);
  ev_stop(h);
}

static const int SEND_STATES[3] = {CCLD_NCCL_STATE_SEND_GPU_WAIT, CCLD_NCCL_STATE_SEND_PEER_WAIT,
                                   CCLD_NCCL_STATE_SEND_WAIT};
static const int RECV_STATES[3] = {CCLD_NCCL_STATE_RECV_WAIT, CCLD_NCCL_STATE_RECV_FLUSH_WAIT,
                                   CCLD_NCCL_STATE_RECV_GPU_WAIT};

/* One step through its wait states, as NCCL's net proxy records them. The size is known
 * from the second state on (data produced / received). With `stall` set to one of the
 * states the step stays there and its handle is returned; else it completes. */
static int g_send_wait_us; /* how long a send step stays handed to the network: link speed */

static void* proxy_step(void* ctx, void* op, int step, int is_send, int chunk, int stall) {
  struct ev e = {.type = CCLD_NCCL_EV_PROXY_STEP, .parent = op, .step = step};
  void* h = ev_start(ctx, &e);
  const int* states = is_send ? SEND_STATES : RECV_STATES;
  for (int i = 0; i < 3; i++) {
    ev_state(h, states[i], i ? (uint64_t)chunk : 0);
    if (states[i] == stall) return h;
    if (states[i] == CCLD_NCCL_STATE_SEND_WAIT && g_send_wait_us) usleep(g_send_wait_us);
  }
  ev_stop(h);
  return NULL;
}

struct stall {
  int step;     /* step index (from 0) that stalls; -1: none */
  int state;    /* the state it stalls in */
  int pipeline; /* later steps started behind it, left in their first state */
};
static const struct stall NO_STALL = {-1, 0, 0};
#define NOT_POSTED (-1) /* stall.state: the op posts no step from stall.step on */

/* Steps base .. base+nsteps-1 of one proxy op; returns 1 if it stalled (op left open). */
static int run_steps(void* ctx, void* op, int base, int nsteps, int is_send, int chunk,
                     struct stall st) {
  for (int s = 0; s < nsteps; s++) {
    if (s == st.step && st.state == NOT_POSTED) return 1;
    if (s == st.step) {
      proxy_step(ctx, op, base + s, is_send, chunk, st.state);
      int first_state = is_send ? SEND_STATES[0] : RECV_STATES[0];
      for (int k = 1; k <= st.pipeline && s + k < nsteps; k++)
        proxy_step(ctx, op, base + s + k, is_send, chunk, first_state);
      return 1;
    }
    proxy_step(ctx, op, base + s, is_send, chunk, 0);
  }
  ev_stop(op);
  return 0;
}

/* ------------------------------------------------------------------ output */
static void print_stats(void) {
  ccld_nccl_stats_t s;
  p_ccld_nccl_stats(&s);
  printf("\"bad_returns\": %d, \"unwritten_handles\": %d, \"warnings\": %d, "
         "\"stats\": {\"comms\": %llu, \"traced\": %llu, \"untraced\": %llu, "
         "\"trace_mismatch\": %llu, \"foreign_ops\": %llu, \"dropped\": %llu, "
         "\"no_board\": %llu, \"live_events\": %llu, \"live_channels\": %llu}",
         g_bad_returns, g_unwritten_handles, g_warnings, (unsigned long long)s.comms,
         (unsigned long long)s.traced, (unsigned long long)s.untraced,
         (unsigned long long)s.trace_mismatch, (unsigned long long)s.foreign_ops,
         (unsigned long long)s.dropped, (unsigned long long)s.no_board,
         (unsigned long long)s.live_events, (unsigned long long)s.live_channels);
}

static ccld_board* make_board(const char* path, int rank, int world, uint32_t max_channels) {
  ccld_board* b = p_ccld_board_create(path, rank, world, "harness", "harness-host", 1024, 16,
                                      max_channels, 256);
  if (!b) die("harness: cannot create board %s\n", path);
  return b;
}

/* ------------------------------------------------------------------ ring all-reduce */
/* One rank of an 8-rank ring all-reduce on 2 channels. The group is the odd global ranks
 * (comm rank i is global rank 2i+1) so that the local -> global peer mapping shows. Op 1
 * completes everywhere; op 2 stalls: rank 3's GPU (its sends wait for data, its receives
 * for the GPU to consume), rank 2 waits for rank 3's credit, and the link 6 -> 7 is down
 * (rank 6's sends and rank 7's receives wait on the network). */
enum { RING_N = 8, RING_STEPS = 8, RING_CHUNK = 1 << 17 };

struct ring_arg {
  void* ctx;
  void* task;
  int rank, op, n;
  int fault, where; /* ring_fault: a fault and where it is; fault < 0: ring_stalls */
};

static void ring_stalls(int rank, int op, struct stall* send, struct stall* recv) {
  *send = *recv = NO_STALL;
  if (op != 2) return;
  if (rank == 3) {
    *send = (struct stall){2, CCLD_NCCL_STATE_SEND_GPU_WAIT, 0};
    *recv = (struct stall){2, CCLD_NCCL_STATE_RECV_GPU_WAIT, 0};
  } else if (rank == 2) {
    *send = (struct stall){3, CCLD_NCCL_STATE_SEND_PEER_WAIT, 0};
  } else if (rank == 6) {
    /* The GPU keeps producing the next two chunks behind the stuck one. */
    *send = (struct stall){5, CCLD_NCCL_STATE_SEND_WAIT, 2};
  } else if (rank == 7) {
    *recv = (struct stall){5, CCLD_NCCL_STATE_RECV_WAIT, 0};
  }
}

/* One fault in a ring, and how it spreads (rank r sends to r+1, receives from r-1):
 *   FAULT_GPU at S: S's GPU is stuck. Data from S-1 arrived and is not consumed, S produces
 *     nothing; S-1's sends wait for S's credit; everyone else is starved (receives wait
 *     for data, sends wait for their GPU, which has nothing to forward).
 *   FAULT_CREDIT at S: S's receive side posts no receive (its proxy is stuck), its GPU is
 *     fine and starved; S-1 waits for S's credit and, held back, does not consume its own
 *     input; the rest are starved.
 *   FAULT_LINK at S: the link S -> S+1 drops everything. S's steps handed to the network
 *     do not complete and its kernel, blocked on them, does not consume its input; S+1
 *     waits for the data; S-1 waits for S's credit; the rest are starved. */
enum { FAULT_NONE = 0, FAULT_GPU = 1, FAULT_CREDIT = 2, FAULT_LINK = 3 };
enum { FAULT_STEP = 2 };

static void ring_fault(int fault, int where, int rank, int n, struct stall* send,
                       struct stall* recv) {
  *send = *recv = NO_STALL;
  if (fault == FAULT_NONE) return;
  const int k = FAULT_STEP;
  int d = (rank - where + n) % n;
  *send = (struct stall){k, CCLD_NCCL_STATE_SEND_GPU_WAIT, 0};
  *recv = (struct stall){k, CCLD_NCCL_STATE_RECV_WAIT, 0};
  if (d == n - 1) *send = (struct stall){k + 1, CCLD_NCCL_STATE_SEND_PEER_WAIT, 0};
  if (d == n - 1 && fault == FAULT_CREDIT)
    *recv = (struct stall){k + 1, CCLD_NCCL_STATE_RECV_GPU_WAIT, 0};
  if (d != 0) return;
  if (fault == FAULT_GPU) {
    *send = (struct stall){k, CCLD_NCCL_STATE_SEND_GPU_WAIT, 0};
    *recv = (struct stall){k, CCLD_NCCL_STATE_RECV_GPU_WAIT, 0};
  } else if (fault == FAULT_CREDIT) {
    *recv = (struct stall){k, NOT_POSTED, 0};
  } else if (fault == FAULT_LINK) {
    *send = (struct stall){k, CCLD_NCCL_STATE_SEND_WAIT, 2};
    *recv = (struct stall){k + 1, CCLD_NCCL_STATE_RECV_GPU_WAIT, 0};
  }
}

static void* ring_proxy(void* p) {
  struct ring_arg* a = p;
  struct stall send_st, recv_st;
  if (a->fault < 0)
    ring_stalls(a->rank, a->op, &send_st, &recv_st);
  else
    ring_fault(a->fault, a->where, a->rank, a->n, &send_st, &recv_st);
  int base = RING_STEPS * (a->op - 1); /* steps count per connection, across ops */
  for (int ch = 0; ch < 2; ch++) {
    void* kern = kernel_ch(a->ctx, a->task, ch);
    void* send = proxy_op(a->ctx, a->task, getpid(), ch, (a->rank + 1) % a->n, RING_STEPS,
                          RING_CHUNK, 1);
    void* recv = proxy_op(a->ctx, a->task, getpid(), ch, (a->rank + a->n - 1) % a->n,
                          RING_STEPS, RING_CHUNK, 0);
    int stalled = run_steps(a->ctx, send, base, RING_STEPS, 1, RING_CHUNK, send_st);
    stalled |= run_steps(a->ctx, recv, base, RING_STEPS, 0, RING_CHUNK, recv_st);
    if (!stalled) kernel_ch_done(kern); /* a stalled channel's kernel keeps running */
  }
  return NULL;
}

/* One collective on the calling thread (whose trace id the caller has set) and its proxy
 * work on a proxy thread, as NCCL runs them. */
static void ring_op(void* ctx, int rank, int n, int op, int fault, int where) {
  struct ring_arg a = {ctx, nccl_task(ctx, 0, 0, 2), rank, op, n, fault, where};
  pthread_t proxy;
  pthread_create(&proxy, NULL, ring_proxy, &a);
  pthread_join(proxy, NULL);
}

static int scenario_ring(const char* path, int rank, int fault, int where) {
  int32_t ranks[RING_N];
  for (int i = 0; i < RING_N; i++) ranks[i] = 2 * i + 1;
  ccld_board* b = make_board(path, ranks[rank], 2 * RING_N, 64);
  const uint64_t gid = 0x0dd0dd0dd0dd0001ull;
  int32_t slot = p_ccld_group_register(b, gid, 0, ranks, RING_N, rank);
  int mask = 0;
  void* ctx = nccl_init(0xc0ffee, RING_N, rank, &mask);
  for (int op = 1; op <= 2; op++) {
    uint64_t index = p_ccld_op_enter(b, (uint32_t)slot, CCLD_OP_ALL_REDUCE, CCLD_FLAG_CUDA,
                                     1u << 24, CCLD_NO_RANK, 0);
    /* fault < 0: the mixed stalls of ring_stalls in op 2; else the fault in op 2 */
    ring_op(ctx, rank, RING_N, op, fault < 0 ? -1 : op == 2 ? fault : FAULT_NONE, where);
    if (op == 1) p_ccld_op_exit(b, index, CCLD_STATE_DONE);
  }
  uint64_t bound = 0;
  int is_bound = p_ccld_nccl_comm_group(0xc0ffee, &bound);
  uint64_t ids[4] = {0}, groups[4] = {0};
  int ncomms = p_ccld_nccl_comms(ids, groups, 4);
  printf("{\"scenario\": \"ring\", \"version\": %d, \"mask\": %d, \"pid\": %d, "
         "\"comm_bound\": %d, \"comm_group\": %llu, \"comms\": [[%llu, %llu]], ",
         g_version, mask, (int)getpid(), is_bound, (unsigned long long)bound,
         (unsigned long long)ids[0], (unsigned long long)groups[0]);
  if (ncomms != 1) die("harness: %d live comms, expected 1\n", ncomms);
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ p2p pair */
/* A send from global rank 2 to global rank 5 over torch's dedicated 2-rank comm (comm rank
 * 0 = global 2), traced as P2P seq 4 of the 8-rank world group. SIDE 0 sends, 1 receives.
 * Channel 0 stalls on the network at step 2; channel 1 completes. */
struct p2p_arg {
  void* ctx;
  void* task;
  int side;
};

static void* p2p_proxy(void* p) {
  struct p2p_arg* a = p;
  int is_send = a->side == 0, peer = 1 - a->side;
  for (int ch = 0; ch < 2; ch++) {
    void* kern = kernel_ch(a->ctx, a->task, ch);
    void* op = proxy_op(a->ctx, a->task, getpid(), ch, peer, 4, 1 << 16, is_send);
    struct stall st = NO_STALL;
    if (ch == 0)
      st = (struct stall){2, is_send ? CCLD_NCCL_STATE_SEND_WAIT : CCLD_NCCL_STATE_RECV_WAIT, 0};
    if (!run_steps(a->ctx, op, 100, 4, is_send, 1 << 16, st)) kernel_ch_done(kern);
  }
  return NULL;
}

static int scenario_p2p(const char* path, int side) {
  int32_t world[8];
  for (int i = 0; i < 8; i++) world[i] = i;
  int me = side == 0 ? 2 : 5, other = side == 0 ? 5 : 2;
  ccld_board* b = make_board(path, me, 8, 64);
  const uint64_t gid = 0x0000000000778899ull;
  int32_t slot = p_ccld_group_register(b, gid, 0, world, 8, me);
  void* ctx = nccl_init(0x25, 2, side, NULL);
  uint8_t flags = CCLD_FLAG_P2P | CCLD_FLAG_CUDA | (side == 0 ? CCLD_FLAG_SEND : 0);
  p_ccld_op_enter(b, (uint32_t)slot, side == 0 ? CCLD_OP_SEND : CCLD_OP_RECV, flags, 1u << 18,
                  other, 4);
  struct p2p_arg a = {ctx, nccl_task(ctx, 1, 1 - side, 2), side};
  pthread_t proxy;
  pthread_create(&proxy, NULL, p2p_proxy, &a);
  pthread_join(proxy, NULL);
  uint64_t bound = 0;
  int is_bound = p_ccld_nccl_comm_group(0x25, &bound);
  printf("{\"scenario\": \"p2p\", \"version\": %d, \"pid\": %d, \"comm_bound\": %d, "
         "\"comm_group\": %llu, ",
         g_version, (int)getpid(), is_bound, (unsigned long long)bound);
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ the GPU clock */
/* Traced all-reduces whose two kernel channels carry GPU timer stamps: the timer is the
 * host's monotonic clock from another epoch (and, with `jump`, moved by 5 s before the
 * second half of the ops). Each kernel starts 200 us after the call, channel 1 later than
 * channel 0 and stopping first. Prints, per op, its ring index and its true host-time
 * start and end (channel 0's start, channel 0's stop). */
static void* kernel_ch_at(void* ctx, void* parent, int ch, uint64_t timer) {
  struct ev e = {.type = CCLD_NCCL_EV_KERNEL_CH, .parent = parent};
  e.kch.channelId = (uint8_t)ch;
  e.kch.pTimer = timer;
  return ev_start(ctx, &e);
}

static void kernel_ch_stop_at(void* h, uint64_t timer) {
  ev_state(h, CCLD_NCCL_STATE_KERNEL_CH_STOP, timer);
  ev_stop(h);
}

static int scenario_gpuclock(const char* path, int jump) {
  int32_t world[2] = {0, 1};
  ccld_board* b = make_board(path, 0, 2, 64);
  int32_t slot = p_ccld_group_register(b, 0x61C10C, 0, world, 2, 0);
  void* ctx = nccl_init(0x31, 2, 0, NULL);
  printf("{\"scenario\": \"gpuclock\", \"version\": %d, \"ops\": [", g_version);
  for (int i = 0; i < 12; i++) {
    uint64_t epoch = 1700000000000000000ull + (jump && i >= 6 ? 5000000000ull : 0);
    uint64_t index = p_ccld_op_enter(b, (uint32_t)slot, CCLD_OP_ALL_REDUCE,
                                     CCLD_FLAG_CUDA | CCLD_FLAG_DEVICE, 1024, CCLD_NO_RANK, 0);
    void* task = nccl_task(ctx, 0, -1, 2);
    usleep(200);
    int64_t start = p_ccld_now_ns();
    void* ch0 = kernel_ch_at(ctx, task, 0, (uint64_t)start + epoch);
    usleep(100);
    void* ch1 = kernel_ch_at(ctx, task, 1, (uint64_t)p_ccld_now_ns() + epoch);
    usleep(500);
    kernel_ch_stop_at(ch1, (uint64_t)p_ccld_now_ns() + epoch);
    usleep(100);
    int64_t end = p_ccld_now_ns();
    kernel_ch_stop_at(ch0, (uint64_t)end + epoch);
    p_ccld_op_exit(b, index, CCLD_STATE_DONE);
    printf("%s[%llu, %lld, %lld]", i ? ", " : "", (unsigned long long)index, (long long)start,
           (long long)end);
  }
  printf("], ");
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ edge cases */
struct launch_arg {
  void* ctx;
  void* api;
  void* task;
};

/* v5+: a non-blocking comm launches on another thread, which has no trace id. */
static void* launch_elsewhere(void* p) {
  struct launch_arg* a = p;
  a->task = ev_start(a->ctx, &(struct ev){.type = CCLD_NCCL_EV_COLL, .parent = a->api});
  ev_stop(a->task);
  return NULL;
}

static int count_board_records(ccld_board* b) {
  ccld_header* h = p_ccld_board_header(b);
  static ccld_channel copy[1024];
  uint32_t n = h->max_channels < 1024 ? h->max_channels : 1024;
  p_ccld_copy_records(p_ccld_board_channels(b), copy, n, sizeof(ccld_channel));
  int used = 0;
  for (uint32_t i = 0; i < n; i++)  /* live records: the per-link totals are not counted */
    used += copy[i].source != CCLD_SRC_NONE && copy[i].channel_id != CCLD_CHANNEL_TOTAL;
  return used;
}

/* steps_done of the record on channel `ch`, or -1. */
static long long record_steps_done(ccld_board* b, int ch) {
  ccld_header* h = p_ccld_board_header(b);
  static ccld_channel copy[1024];
  uint32_t n = h->max_channels < 1024 ? h->max_channels : 1024;
  p_ccld_copy_records(p_ccld_board_channels(b), copy, n, sizeof(ccld_channel));
  for (uint32_t i = 0; i < n; i++)
    if (copy[i].source != CCLD_SRC_NONE && copy[i].channel_id == ch)
      return (long long)copy[i].steps_done;
  return -1;
}

enum { EDGE_CHANNELS = 24 };

static int scenario_edge(const char* path) {
  int32_t ranks[4] = {40, 41, 42, 43};
  ccld_board* b = make_board(path, 40, 64, EDGE_CHANNELS);
  const uint64_t gid = 0x0000000000e00e00ull, other_gid = 0x0000000000abcabcull;
  int32_t slot = p_ccld_group_register(b, gid, 0, ranks, 4, 0);
  int32_t other_ranks[2] = {40, 50};
  int32_t other_slot = p_ccld_group_register(b, other_gid, 0, other_ranks, 2, 0);
  void* ctx = nccl_init(0xed9e, 4, 0, NULL);
  pid_t me = getpid();
  int results = 0; /* bit i: check i behaved */

  /* 1. A traced collective binds the comm; its proxy op (channel 0) stays open. */
  p_ccld_op_enter(b, (uint32_t)slot, CCLD_OP_ALL_REDUCE, 0, 4096, CCLD_NO_RANK, 0);
  void* task1 = nccl_task(ctx, 0, 0, 1);
  p_ccld_clear_current_trace();
  void* op1 = proxy_op(ctx, task1, me, 0, 1, 4, 4096, 1);
  proxy_step(ctx, op1, 0, 1, 4096, CCLD_NCCL_STATE_SEND_PEER_WAIT);

  /* 2. PXN: a proxy op of another process, whose parentObj would fault if dereferenced. */
  void* foreign = proxy_op(ctx, (void*)16, me ^ 0x40000000, 3, 2, 4, 4096, 0);
  proxy_step(ctx, foreign, 7, 0, 4096, CCLD_NCCL_STATE_RECV_WAIT);
  results |= (foreign != NULL) << 0;

  /* 3. Our pid but a parent that is not one of our handles: tracked, seq unknown. */
  int junk = 0;
  void* orphan = proxy_op(ctx, &junk, me, 4, 3, 4, 4096, 1);
  results |= (orphan != NULL) << 1;

  /* 4. A context that is not ours: no task; a proxy op is tracked with nothing known. */
  void* bad_task = ev_start(&junk, &(struct ev){.type = CCLD_NCCL_EV_COLL});
  void* bad_ctx_op = proxy_op(&junk, NULL, me, 5, 1, 4, 4096, 1);
  results |= (bad_task == NULL) << 2;
  results |= (bad_ctx_op != NULL) << 3;

  /* 5. Steps whose parent is not a proxy op of ours. */
  void* step_no_parent = ev_start(ctx, &(struct ev){.type = CCLD_NCCL_EV_PROXY_STEP});
  void* step_task_parent =
      ev_start(ctx, &(struct ev){.type = CCLD_NCCL_EV_PROXY_STEP, .parent = task1});
  results |= (step_no_parent == NULL && step_task_parent == NULL) << 4;

  /* 6. Events we do not track get NULL; handles we never gave are ignored. */
  static const uint64_t untracked[] = {CCLD_NCCL_EV_PROXY_CTRL, CCLD_NCCL_EV_NET_PLUGIN,
                                       CCLD_NCCL_EV_KERNEL_LAUNCH, CCLD_NCCL_EV_CE_COLL,
                                       CCLD_NCCL_EV_CE_SYNC, CCLD_NCCL_EV_CE_BATCH};
  int all_null = 1;
  for (size_t i = 0; i < sizeof untracked / sizeof untracked[0]; i++) {
    if (g_version == 4 && untracked[i] > CCLD_NCCL_EV_NET_PLUGIN) continue;
    all_null &= ev_start(ctx, &(struct ev){.type = untracked[i]}) == NULL;
  }
  results |= all_null << 5;
  ev_stop(&junk);
  ev_state(&junk, CCLD_NCCL_STATE_SEND_WAIT, 1);
  ev_stop((char*)task1 + 1);
  ev_stop((char*)op1 + 1);
  ev_state((char*)op1 + 1, CCLD_NCCL_STATE_PROXY_OP_IN_PROGRESS, 0);
  void* twice = proxy_step(ctx, op1, 1, 1, 4096, CCLD_NCCL_STATE_SEND_GPU_WAIT);
  ev_stop(twice);
  ev_stop(twice); /* a double stop must be harmless */
  ev_state(twice, CCLD_NCCL_STATE_SEND_WAIT, 1);

  /* 7. A stale trace of another group: ignored (the comm belongs to gid). */
  p_ccld_op_enter(b, (uint32_t)other_slot, CCLD_OP_BARRIER, 0, 0, CCLD_NO_RANK, 0);
  void* task_mismatch = nccl_task(ctx, 0, 0, 1);
  p_ccld_clear_current_trace();
  void* op_mismatch = proxy_op(ctx, task_mismatch, me, 6, 1, 4, 4096, 1);

  /* 8. No trace at all on the calling thread. */
  void* task_untraced = nccl_task(ctx, 0, 0, 1);
  void* op_untraced = proxy_op(ctx, task_untraced, me, 7, 1, 4, 4096, 1);

  /* 9. v5+: the launch on another thread inherits the trace taken at the API event. */
  void* op_elsewhere = NULL;
  if (g_version >= 5) {
    p_ccld_op_enter(b, (uint32_t)slot, CCLD_OP_ALL_REDUCE, 0, 4096, CCLD_NO_RANK, 0);
    struct launch_arg la = {ctx, NULL, NULL};
    la.api = ev_start(ctx, &(struct ev){.type = CCLD_NCCL_EV_COLL_API});
    ev_stop(la.api);
    p_ccld_clear_current_trace();
    pthread_t t;
    pthread_create(&t, NULL, launch_elsewhere, &la);
    pthread_join(t, NULL);
    op_elsewhere = proxy_op(ctx, la.task, me, 8, 2, 4, 4096, 0);
  }

  /* 10. The board's channel table fills up: further records are dropped, not forced. */
  int before_fill = count_board_records(b);
  void* fill[EDGE_CHANNELS + 8];
  int filled = 0, refused = 0;
  for (int i = 0; i < EDGE_CHANNELS + 8; i++) {
    fill[i] = proxy_op(ctx, task1, me, 16 + i, 1, 4, 4096, 1);
    filled += fill[i] != NULL;
    refused += fill[i] == NULL;
  }
  int full_records = count_board_records(b);
  for (int i = 0; i < EDGE_CHANNELS + 8; i++) ev_stop(fill[i]);
  int after_fill = count_board_records(b);

  /* 11. The event pool runs out: step handles become NULL, then all come back. */
  void* pool_op = proxy_op(ctx, task1, me, 9, 1, 1 << 20, 4096, 1);
  ccld_nccl_stats_t s0, s1, s2;
  p_ccld_nccl_stats(&s0);
  enum { MANY = 40000 };
  static void* steps[MANY];
  int null_steps = 0;
  for (int i = 0; i < MANY; i++) {
    steps[i] = ev_start(ctx, &(struct ev){.type = CCLD_NCCL_EV_PROXY_STEP, .parent = pool_op,
                                          .step = i});
    null_steps += steps[i] == NULL;
  }
  p_ccld_nccl_stats(&s1);
  for (int i = 0; i < MANY; i++) ev_stop(steps[i]);
  ev_stop(pool_op);
  p_ccld_nccl_stats(&s2);

  /* 12. Two proxy ops of one task on one (channel, peer, direction) share a record; the
   * second stop releases it. */
  int base = count_board_records(b);
  void* sh1 = proxy_op(ctx, task1, me, 10, 1, 2, 4096, 1);
  void* sh2 = proxy_op(ctx, task1, me, 10, 1, 2, 4096, 1);
  int shared_two = count_board_records(b) - base;
  proxy_step(ctx, sh1, 0, 1, 4096, 0);
  proxy_step(ctx, sh2, 0, 1, 4096, 0);
  long long shared_steps = record_steps_done(b, 10);
  ev_stop(sh1);
  int shared_one = count_board_records(b) - base;
  ev_stop(sh2);
  int shared_none = count_board_records(b) - base;

  int records_now = count_board_records(b);
  printf("{\"scenario\": \"edge\", \"shared\": [%d, %lld, %d, %d], ", shared_two,
         shared_steps, shared_one, shared_none);
  printf("\"version\": %d, \"pid\": %d, \"results\": %d, "
         "\"v5_launch_tracked\": %d, \"before_fill\": %d, \"filled\": %d, \"refused\": %d, "
         "\"full_records\": %d, \"after_fill\": %d, \"null_steps\": %d, "
         "\"live_events_before\": %llu, \"live_events_full\": %llu, \"live_events_after\": %llu, "
         "\"records_now\": %d, \"board_errors\": %llu, \"tracked\": [%d, %d, %d, %d], ",
         g_version, (int)me, results, op_elsewhere != NULL, before_fill, filled, refused,
         full_records, after_fill, null_steps, (unsigned long long)s0.live_events,
         (unsigned long long)s1.live_events, (unsigned long long)s2.live_events, records_now,
         (unsigned long long)p_ccld_board_header(b)->errors, op1 != NULL, op_mismatch != NULL,
         op_untraced != NULL, orphan != NULL);
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ concurrency */
/* Caller threads (one comm each) issue traced collectives while two proxy threads run
 * their proxy ops and kernel channels, as NCCL's threads would. Each proxy thread checks,
 * mid-op, that the board shows the op's record under the right (group_id, seq). */
enum { T_COMMS = 4, T_OPS = 2000, T_QUEUE = 64, T_STEPS = 4 };

struct item {
  void* task;
  uint64_t group_id, seq;
};

struct queue {
  struct item items[T_QUEUE];
  uint64_t head, tail;
  int closed;
};

static struct {
  ccld_board* board;
  int32_t slot[T_COMMS];
  uint64_t gid[T_COMMS];
  void* ctx[T_COMMS];
  struct queue q[T_COMMS];
  int processed, mismatches;
} T;

static void* caller(void* p) {
  int k = (int)(intptr_t)p;
  struct queue* q = &T.q[k];
  for (int i = 0; i < T_OPS; i++) {
    uint64_t index = p_ccld_op_enter(T.board, (uint32_t)T.slot[k], CCLD_OP_ALL_REDUCE,
                                     CCLD_FLAG_CUDA, 1 << 20, CCLD_NO_RANK, 0);
    struct item it = {nccl_task(T.ctx[k], 0, 0, 2), T.gid[k], (uint64_t)i + 1};
    p_ccld_op_exit(T.board, index, CCLD_STATE_DONE);
    while (q->tail - __atomic_load_n(&q->head, __ATOMIC_ACQUIRE) == T_QUEUE) sched_yield();
    q->items[q->tail % T_QUEUE] = it;
    __atomic_store_n(&q->tail, q->tail + 1, __ATOMIC_RELEASE);
  }
  __atomic_store_n(&q->closed, 1, __ATOMIC_RELEASE);
  return NULL;
}

static int board_has(uint64_t gid, uint64_t seq, int ch, int dir) {
  static __thread ccld_channel copy[256];
  uint32_t n = p_ccld_board_header(T.board)->max_channels;
  p_ccld_copy_records(p_ccld_board_channels(T.board), copy, n, sizeof(ccld_channel));
  for (uint32_t i = 0; i < n; i++)
    if ((copy[i].lock & 1u) == 0 && copy[i].source == CCLD_SRC_NCCL && copy[i].group_id == gid &&
        copy[i].seq == seq && copy[i].channel_id == ch && copy[i].direction == dir)
      return 1;
  return 0;
}

static void* proxy_thread(void* p) {
  int first = (int)(intptr_t)p; /* serves comms first and first + 2 */
  int open = 2;
  while (open) {
    open = 0;
    for (int k = first; k < T_COMMS; k += 2) {
      struct queue* q = &T.q[k];
      uint64_t tail = __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE);
      if (q->head == tail) {
        open += !__atomic_load_n(&q->closed, __ATOMIC_ACQUIRE) ||
                q->head != __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE);
        continue;
      }
      open++;
      struct item it = q->items[q->head % T_QUEUE];
      __atomic_store_n(&q->head, q->head + 1, __ATOMIC_RELEASE);
      void* ctx = T.ctx[k];
      int ch = (int)(it.seq % 2);
      void* kern = kernel_ch(ctx, it.task, ch);
      void* send = proxy_op(ctx, it.task, getpid(), ch, 1, T_STEPS, 1 << 18, 1);
      void* recv = proxy_op(ctx, it.task, getpid(), ch, 3, T_STEPS, 1 << 18, 0);
      int base = (int)it.seq * T_STEPS;
      proxy_step(ctx, send, base, 1, 1 << 18, 0);
      if (!board_has(it.group_id, it.seq, ch, CCLD_DIR_SEND))
        __atomic_add_fetch(&T.mismatches, 1, __ATOMIC_RELAXED);
      for (int s = 1; s < T_STEPS; s++) proxy_step(ctx, send, base + s, 1, 1 << 18, 0);
      for (int s = 0; s < T_STEPS; s++) proxy_step(ctx, recv, base + s, 0, 1 << 18, 0);
      ev_stop(send);
      ev_stop(recv);
      kernel_ch_done(kern);
      __atomic_add_fetch(&T.processed, 1, __ATOMIC_RELAXED);
    }
  }
  return NULL;
}

static int scenario_threads(const char* path) {
  T.board = make_board(path, 0, 64, 256);
  for (int k = 0; k < T_COMMS; k++) {
    int32_t ranks[4] = {0, 1 + k, 5 + k, 9 + k};
    T.gid[k] = 0x7000 + (uint64_t)k;
    T.slot[k] = p_ccld_group_register(T.board, T.gid[k], 0, ranks, 4, 0);
    T.ctx[k] = nccl_init(0xabc0 + (uint64_t)k, 4, 0, NULL);
  }
  pthread_t callers[T_COMMS], proxies[2];
  for (int j = 0; j < 2; j++) pthread_create(&proxies[j], NULL, proxy_thread, (void*)(intptr_t)j);
  for (int k = 0; k < T_COMMS; k++) pthread_create(&callers[k], NULL, caller, (void*)(intptr_t)k);
  for (int k = 0; k < T_COMMS; k++) pthread_join(callers[k], NULL);
  for (int j = 0; j < 2; j++) pthread_join(proxies[j], NULL);
  int bound_ok = 1;
  for (int k = 0; k < T_COMMS; k++) {
    uint64_t g = 0;
    bound_ok &= p_ccld_nccl_comm_group(0xabc0 + (uint64_t)k, &g) && g == T.gid[k];
    nccl_finalize(T.ctx[k]);
  }
  printf("{\"scenario\": \"threads\", \"version\": %d, \"processed\": %d, \"expected\": %d, "
         "\"mismatches\": %d, \"bound_ok\": %d, \"records_now\": %d, ",
         g_version, T.processed, T_COMMS * T_OPS, T.mismatches, bound_ok,
         count_board_records(T.board));
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ cost per event */
static int scenario_bench(const char* path) {
  int32_t ranks[2] = {0, 1};
  ccld_board* b = make_board(path, 0, 2, 64);
  int32_t slot = p_ccld_group_register(b, 0xbe4c, 0, ranks, 2, 0);
  void* ctx = nccl_init(0xbe4c, 2, 0, NULL);
  p_ccld_op_enter(b, (uint32_t)slot, CCLD_OP_ALL_REDUCE, 0, 1 << 20, CCLD_NO_RANK, 0);
  void* task = nccl_task(ctx, 0, 0, 1);

  /* Steps: start, three states, stop = 5 events, each rewriting the board record. */
  enum { STEPS = 200000, TASKS = 100000, OPS = 100000 };
  void* op = proxy_op(ctx, task, getpid(), 0, 1, STEPS, 1 << 17, 1);
  int64_t t0 = p_ccld_now_ns();
  for (int i = 0; i < STEPS; i++) proxy_step(ctx, op, i, 1, 1 << 17, 0);
  int64_t t1 = p_ccld_now_ns();
  ev_stop(op);

  /* Caller side per collective: Group (+ GroupApi, CollApi from v5), Coll, starts and stops. */
  int per_task = g_version >= 5 ? 8 : 4;
  int64_t t2 = p_ccld_now_ns();
  for (int i = 0; i < TASKS; i++) nccl_task(ctx, 0, 0, 1);
  int64_t t3 = p_ccld_now_ns();

  /* Proxy op start + stop: claims and releases a board record each time. */
  int64_t t4 = p_ccld_now_ns();
  for (int i = 0; i < OPS; i++) ev_stop(proxy_op(ctx, task, getpid(), 1, 1, 1, 1 << 17, 1));
  int64_t t5 = p_ccld_now_ns();

  printf("{\"scenario\": \"bench\", \"version\": %d, \"step_event_ns\": %.1f, "
         "\"caller_event_ns\": %.1f, \"proxy_op_event_ns\": %.1f, ",
         g_version, (double)(t1 - t0) / (5.0 * STEPS),
         (double)(t3 - t2) / ((double)per_task * TASKS), (double)(t5 - t4) / (3.0 * OPS));
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ abort */
/* A comm finalized with an op in flight (ncclCommAbort): its records leave the board, and
 * stops that arrive late are harmless. */
static int scenario_abort(const char* path) {
  int32_t ranks[2] = {0, 1};
  ccld_board* b = make_board(path, 0, 2, 16);
  int32_t slot = p_ccld_group_register(b, 0xab0, 0, ranks, 2, 0);
  void* ctx = nccl_init(0xab0, 2, 0, NULL);
  p_ccld_op_enter(b, (uint32_t)slot, CCLD_OP_ALL_REDUCE, 0, 4096, CCLD_NO_RANK, 0);
  void* task = nccl_task(ctx, 0, 0, 1);
  void* kern = kernel_ch(ctx, task, 0);
  void* op = proxy_op(ctx, task, getpid(), 0, 1, 4, 4096, 1);
  void* step = proxy_step(ctx, op, 0, 1, 4096, CCLD_NCCL_STATE_SEND_WAIT);
  int in_flight = count_board_records(b);
  nccl_finalize(ctx);
  int after_finalize = count_board_records(b);
  ev_state(step, CCLD_NCCL_STATE_SEND_WAIT, 4096);
  ev_stop(step);
  ev_stop(op);
  kernel_ch_done(kern);
  printf("{\"scenario\": \"abort\", \"version\": %d, \"in_flight\": %d, "
         "\"after_finalize\": %d, \"after_stops\": %d, ",
         g_version, in_flight, after_finalize, count_board_records(b));
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ no board */
static int scenario_noboard(void) {
  void* ctx = nccl_init(0x0b0a, 2, 0, NULL);
  void* task = nccl_task(ctx, 0, 0, 1);
  void* op = proxy_op(ctx, task, getpid(), 0, 1, 2, 4096, 1);
  void* kern = kernel_ch(ctx, task, 0);
  void* step = proxy_step(ctx, op, 0, 1, 4096, CCLD_NCCL_STATE_SEND_WAIT);
  ev_stop(step);
  ev_stop(op);
  kernel_ch_done(kern);
  nccl_finalize(ctx);
  printf("{\"scenario\": \"noboard\", \"version\": %d, \"handles\": %d, \"ctx\": %d, ",
         g_version, (task != NULL) + (op != NULL) + (kern != NULL) + (step != NULL),
         ctx != NULL);
  print_stats();
  printf("}\n");
  return 0;
}

/* ------------------------------------------------------------------ layout */
#define OFF(type, field) printf("\"%s.%s\": %zu, ", #type, #field, offsetof(type, field))
static int scenario_layout(void) {
  printf("{\"scenario\": \"layout\", \"version\": %d, \"channel_size\": %zu, ", g_version,
         sizeof(ccld_channel));
  OFF(ccld_header, magic);
  OFF(ccld_header, max_channels);
  OFF(ccld_header, channels_off);
  OFF(ccld_header, errors);
  OFF(ccld_channel, lock);
  OFF(ccld_channel, source);
  OFF(ccld_channel, direction);
  OFF(ccld_channel, wait);
  OFF(ccld_channel, channel_id);
  OFF(ccld_channel, peer);
  OFF(ccld_channel, pid);
  OFF(ccld_channel, group_id);
  OFF(ccld_channel, seq);
  OFF(ccld_channel, steps_posted);
  OFF(ccld_channel, steps_done);
  OFF(ccld_channel, bytes_done);
  OFF(ccld_channel, first_ns);
  OFF(ccld_channel, last_progress_ns);
  int mask = 0;
  nccl_init(0x1a, 1, 0, &mask);
  printf("\"mask\": %d, ", mask);
  print_stats();
  printf("}\n");
  return 0;
}

#ifdef CCLD_HARNESS_LIB
/* Library mode, for live jobs (a real torch.distributed job whose ranks load the plugin
 * through ccld_plugin): one ring all-reduce of `nranks` ranks with `fault` at comm rank
 * `where`, driven through the plugin `lib` (the copy the process has loaded, so the events
 * reach the process board). The caller has entered the op on the board on this thread,
 * as the tracer does before the real collective; the op is left in flight. Returns the
 * number of interface calls that failed (0 when all went well). */
int ccld_harness_ring(const char* lib, uint64_t comm_hash, int nranks, int rank, int fault,
                      int where) {
  if (!g_sym) load(lib, 0);
  void* ctx = nccl_init(comm_hash, nranks, rank, NULL);
  ring_op(ctx, rank, nranks, 1, fault, where);
  return g_bad_returns + g_unwritten_handles;
}

/* Library mode: one fault-free ring all-reduce on this process's comm (created at the
 * first call), each send step staying `send_wait_us` in the network wait: a slow link
 * when it is large for one rank's sends. Returns the failed interface calls so far. */
int ccld_harness_ring_timed(const char* lib, uint64_t comm_hash, int nranks, int rank,
                            int send_wait_us) {
  static void* ctx;
  if (!g_sym) load(lib, 0);
  if (!ctx) ctx = nccl_init(comm_hash, nranks, rank, NULL);
  g_send_wait_us = send_wait_us;
  ring_op(ctx, rank, nranks, 1, FAULT_NONE, 0);
  return g_bad_returns + g_unwritten_handles;
}
#else
int main(int argc, char** argv) {
  if (argc < 5) die("usage: %s LIB VERSION SCENARIO BOARD [ARG...]\n", argv[0]);
  load(argv[1], atoi(argv[2]));
  const char* scenario = argv[3];
  const char* board = argv[4];
  int arg = argc > 5 ? atoi(argv[5]) : 0;
  if (!strcmp(scenario, "ring")) return scenario_ring(board, arg, -1, 0);
  if (!strcmp(scenario, "ringfault"))
    return scenario_ring(board, arg, argc > 6 ? atoi(argv[6]) : 0, argc > 7 ? atoi(argv[7]) : 0);
  if (!strcmp(scenario, "p2p")) return scenario_p2p(board, arg);
  if (!strcmp(scenario, "gpuclock")) return scenario_gpuclock(board, arg);
  if (!strcmp(scenario, "edge")) return scenario_edge(board);
  if (!strcmp(scenario, "threads")) return scenario_threads(board);
  if (!strcmp(scenario, "bench")) return scenario_bench(board);
  if (!strcmp(scenario, "abort")) return scenario_abort(board);
  if (!strcmp(scenario, "noboard")) return scenario_noboard();
  if (!strcmp(scenario, "layout")) return scenario_layout();
  die("harness: unknown scenario %s\n", scenario);
  return 2;
}
#endif
