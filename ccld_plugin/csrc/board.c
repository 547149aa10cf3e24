/* The board: creation, lock-free writers and the seqlock copy used by readers. */
#define _GNU_SOURCE
#include "board.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(ccld_header) % 8 == 0, "header must stay 8-byte aligned");
_Static_assert(sizeof(ccld_group) == 64, "group record is 64 bytes");
_Static_assert(sizeof(ccld_op_record) == 88, "op record is 88 bytes");
_Static_assert(sizeof(ccld_channel) == 128, "channel record is 128 bytes");

struct ccld_board {
  ccld_header* hdr;
  size_t size;
  int fd;
  uint32_t ring_mask;
  char* path;
};

static ccld_board* g_process_board;

static __thread struct {
  uint64_t group_id, seq, index;
  int valid;
} t_current;

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define RELAXED_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

int64_t ccld_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint32_t round_pow2(uint32_t v) {
  uint32_t p = 1;
  while (p < v && p < (1u << 30)) p <<= 1;
  return p;
}

static size_t align64(size_t v) { return (v + 63) & ~(size_t)63; }

size_t ccld_board_size(uint32_t ring_size, uint32_t max_groups, uint32_t max_channels,
                       uint32_t rank_pool_size) {
  size_t s = align64(sizeof(ccld_header));
  s += align64((size_t)max_groups * sizeof(ccld_group));
  s += align64((size_t)round_pow2(ring_size) * sizeof(ccld_op_record));
  s += align64((size_t)max_channels * sizeof(ccld_channel));
  s += align64((size_t)rank_pool_size * sizeof(int32_t));
  return s;
}

/* Empty the file and give it `size` bytes of zeros whose pages exist now: the board is a
 * shared mapping, and a write to a page that a full filesystem cannot give is a SIGBUS in
 * the training process. A folder without room is told here, as ENOSPC. Returns 0 or an
 * errno value. */
static int reserve(int fd, size_t size) {
  struct stat st;
  if (fstat(fd, &st) != 0) return errno;
  if (!S_ISREG(st.st_mode)) return EINVAL;
  if (ftruncate(fd, 0) != 0) return errno;
  int err;
  /* posix_fallocate returns its error (errno is left alone); a signal can interrupt it */
  do {
    err = posix_fallocate(fd, 0, (off_t)size);
  } while (err == EINTR);
  return err;
}

ccld_board* ccld_board_create(const char* path, int32_t rank, int32_t world, const char* job,
                              const char* host, uint32_t ring_size, uint32_t max_groups,
                              uint32_t max_channels, uint32_t rank_pool_size) {
  if (ring_size == 0 || max_groups == 0 || max_groups > 65535 || rank_pool_size == 0) {
    errno = EINVAL;
    return NULL;
  }
  ring_size = round_pow2(ring_size);
  size_t size = ccld_board_size(ring_size, max_groups, max_channels, rank_pool_size);
  /* Never through a link; mode 0600 for a new file (the board is the user's own). */
  int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return NULL;
  int err = reserve(fd, size);
  if (err != 0) {
    close(fd);
    errno = err;
    return NULL;
  }
  void* mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mem == MAP_FAILED) {
    int e = errno;
    close(fd);
    errno = e;
    return NULL;
  }
  ccld_board* b = calloc(1, sizeof(*b));
  if (!b) {
    munmap(mem, size);
    close(fd);
    errno = ENOMEM;
    return NULL;
  }
  b->hdr = mem;
  b->size = size;
  b->fd = fd;
  b->ring_mask = ring_size - 1;
  b->path = strdup(path);

  ccld_header* h = b->hdr;
  h->version = CCLD_BOARD_VERSION;
  h->header_size = sizeof(ccld_header);
  h->file_size = size;
  h->rank = rank;
  h->world = world;
  h->pid = (int32_t)getpid();
  h->ring_size = ring_size;
  h->max_groups = max_groups;
  h->max_channels = max_channels;
  h->rank_pool_size = rank_pool_size;
  size_t off = align64(sizeof(ccld_header));
  h->groups_off = (uint32_t)off;
  off += align64((size_t)max_groups * sizeof(ccld_group));
  h->ring_off = (uint32_t)off;
  off += align64((size_t)ring_size * sizeof(ccld_op_record));
  h->channels_off = (uint32_t)off;
  off += align64((size_t)max_channels * sizeof(ccld_channel));
  h->rank_pool_off = (uint32_t)off;
  h->start_wall_ns = wall_ns();
  h->start_mono_ns = ccld_now_ns();
  h->heartbeat_ns = h->start_mono_ns;
  strncpy(h->host, host ? host : "", sizeof(h->host) - 1);
  strncpy(h->job, job ? job : "", sizeof(h->job) - 1);
  /* The magic goes last: a reader never accepts a half-initialized header. */
  STORE(&h->magic, CCLD_BOARD_MAGIC);

  ccld_board* expected = NULL;
  __atomic_compare_exchange_n(&g_process_board, &expected, b, 0, __ATOMIC_ACQ_REL,
                              __ATOMIC_ACQUIRE);
  return b;
}

void ccld_board_close(ccld_board* b, int unlink_file) {
  if (!b) return;
  ccld_board* self = b;
  int was_process_board = __atomic_compare_exchange_n(&g_process_board, &self, NULL, 0,
                                                      __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  STORE(&b->hdr->closed, 1);
  if (unlink_file && b->path) unlink(b->path);
  if (was_process_board) {
    /* The NCCL proxy thread may have loaded the board pointer just before we detached
     * it: keep the mapping (and its handle) until the process exits. */
    close(b->fd);
    return;
  }
  munmap(b->hdr, b->size);
  close(b->fd);
  free(b->path);
  free(b);
}

ccld_board* ccld_process_board(void) { return LOAD(&g_process_board); }
ccld_header* ccld_board_header(ccld_board* b) { return b->hdr; }

ccld_group* ccld_board_group(ccld_board* b, uint32_t slot) {
  return (ccld_group*)((char*)b->hdr + b->hdr->groups_off) + slot;
}

static ccld_op_record* ring(ccld_board* b) {
  return (ccld_op_record*)((char*)b->hdr + b->hdr->ring_off);
}

ccld_channel* ccld_board_channels(ccld_board* b) {
  return (ccld_channel*)((char*)b->hdr + b->hdr->channels_off);
}

static int32_t* rank_pool(ccld_board* b) {
  return (int32_t*)((char*)b->hdr + b->hdr->rank_pool_off);
}

int32_t ccld_group_register(ccld_board* b, uint64_t group_id, int32_t role, const int32_t* ranks,
                            int32_t size, int32_t my_index) {
  ccld_header* h = b->hdr;
  /* Registration is rare and happens on the thread that creates groups; the tables are
   * append-only, so readers only need the release on num_groups. */
  uint64_t n = LOAD(&h->num_groups);
  for (uint64_t i = 0; i < n; i++) {
    if (ccld_board_group(b, (uint32_t)i)->group_id == group_id) return (int32_t)i;
  }
  if (n >= h->max_groups || size < 0) return -1;
  uint64_t used = h->rank_pool_used;
  if (used + (uint64_t)size > h->rank_pool_size) return -1;
  memcpy(rank_pool(b) + used, ranks, (size_t)size * sizeof(int32_t));
  STORE(&h->rank_pool_used, used + (uint64_t)size);
  ccld_group* g = ccld_board_group(b, (uint32_t)n);
  g->group_id = group_id;
  g->role = role;
  g->size = size;
  g->ranks_off = (uint32_t)used;
  g->my_index = my_index;
  STORE(&h->num_groups, n + 1);
  return (int32_t)n;
}

void ccld_group_set_role(ccld_board* b, uint32_t slot, int32_t role) {
  if (slot < LOAD(&b->hdr->num_groups)) STORE(&ccld_board_group(b, slot)->role, role);
}

/* Seqlock writer side: take the record (even -> odd), so that two writers of one record
 * (an enter on the main thread, a late exit on the poller) never interleave. */
static uint32_t write_begin(uint32_t* lock) {
  uint32_t l = __atomic_load_n(lock, __ATOMIC_RELAXED);
  for (;;) {
    if (l & 1u) {
      l = __atomic_load_n(lock, __ATOMIC_RELAXED);
      continue;
    }
    if (__atomic_compare_exchange_n(lock, &l, l + 1, 1, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      break;
  }
  __atomic_thread_fence(__ATOMIC_RELEASE);
  return l;
}

static void write_end(uint32_t* lock, uint32_t begun) { STORE(lock, begun + 2); }

static void atomic_max_u64(uint64_t* p, uint64_t v) {
  uint64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v &&
         !__atomic_compare_exchange_n(p, &cur, v, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
  }
}

uint64_t ccld_op_enter(ccld_board* b, uint32_t group_slot, uint16_t op, uint8_t flags,
                       uint64_t bytes, int32_t peer, uint64_t seq) {
  ccld_header* h = b->hdr;
  ccld_group* g = ccld_board_group(b, group_slot);
  int64_t now = ccld_now_ns();
  if (seq == 0) {
    seq = __atomic_add_fetch(&g->entered_seq, 1, __ATOMIC_ACQ_REL);
    RELAXED_STORE(&g->last_enter_ns, now);
  }
  uint64_t index = __atomic_fetch_add(&h->ops_written, 1, __ATOMIC_ACQ_REL);
  ccld_op_record* r = &ring(b)[index & b->ring_mask];
  uint32_t l = write_begin(&r->lock);
  r->op = op;
  r->state = CCLD_STATE_IN_FLIGHT;
  r->flags = flags;
  r->group_slot = (uint16_t)group_slot;
  r->index_lo = (uint32_t)index;
  r->peer = peer;
  r->step = (int32_t)__atomic_load_n(&h->step, __ATOMIC_RELAXED);
  r->group_id = g->group_id;
  r->seq = seq;
  r->bytes = bytes;
  r->enter_ns = now;
  r->exit_ns = 0;
  r->dev_source = CCLD_TIME_NONE;
  r->dev_start_ns = 0;
  r->dev_end_ns = 0;
  r->dev_err_ns = 0;
  write_end(&r->lock, l);
  t_current.group_id = g->group_id;
  t_current.seq = seq;
  t_current.index = index;
  t_current.valid = 1;
  return index;
}

void ccld_op_exit(ccld_board* b, uint64_t index, uint8_t state) {
  int64_t now = ccld_now_ns();
  ccld_op_record* r = &ring(b)[index & b->ring_mask];
  uint32_t l = write_begin(&r->lock);
  int mine = r->index_lo == (uint32_t)index && r->state == CCLD_STATE_IN_FLIGHT;
  uint16_t slot = r->group_slot;
  uint64_t seq = r->seq;
  int p2p = (r->flags & CCLD_FLAG_P2P) != 0;
  int blocking = (r->flags & CCLD_FLAG_ASYNC) == 0;
  int64_t entered = r->enter_ns;
  if (mine) {
    r->state = state;
    r->exit_ns = now;
  }
  write_end(&r->lock, l);
  if (mine && blocking && now > entered)
    __atomic_add_fetch(&b->hdr->blocked_ns, (uint64_t)(now - entered), __ATOMIC_RELAXED);
  if (mine && !p2p) {
    ccld_group* g = ccld_board_group(b, slot);
    atomic_max_u64(&g->completed_seq, seq);
    RELAXED_STORE(&g->last_exit_ns, now);
  }
  if (t_current.valid && t_current.index == index) t_current.valid = 0;
}

void ccld_op_add_bytes(ccld_board* b, uint64_t index, uint64_t bytes) {
  ccld_op_record* r = &ring(b)[index & b->ring_mask];
  uint32_t l = write_begin(&r->lock);
  if (r->index_lo == (uint32_t)index) r->bytes += bytes;
  write_end(&r->lock, l);
}

/* Whether `source` may set a time whose current source is `have` (0: none): a better
 * (lower) or equal one. */
static int takes(uint8_t have, uint8_t source) { return have == CCLD_TIME_NONE || source <= have; }

void ccld_op_set_device(ccld_board* b, uint64_t index, uint8_t source, int64_t start_ns,
                        int64_t end_ns, uint32_t err_ns) {
  if (source == CCLD_TIME_NONE || source > CCLD_TIME_POLL) return;
  ccld_op_record* r = &ring(b)[index & b->ring_mask];
  uint32_t l = write_begin(&r->lock);
  if (r->index_lo == (uint32_t)index && r->state != CCLD_STATE_EMPTY) {
    uint8_t start_src = r->dev_source & 0xF, end_src = r->dev_source >> 4;
    /* from the same source (an op's channels, each with its own times): the earliest
     * start and the latest end */
    if (start_ns > 0 && takes(start_src, source) &&
        !(source == start_src && r->dev_start_ns && r->dev_start_ns < start_ns)) {
      r->dev_start_ns = start_ns;
      start_src = source;
    }
    if (end_ns > 0 && takes(end_src, source) && !(source == end_src && r->dev_end_ns > end_ns)) {
      r->dev_end_ns = end_ns;
      end_src = source;
    }
    if (r->dev_start_ns && r->dev_end_ns && r->dev_end_ns < r->dev_start_ns)
      r->dev_end_ns = r->dev_start_ns; /* two sources that disagree by their errors */
    if (err_ns > r->dev_err_ns) r->dev_err_ns = err_ns;
    r->dev_source = (uint8_t)(start_src | (end_src << 4));
  }
  write_end(&r->lock, l);
}

void ccld_heartbeat(ccld_board* b) { STORE(&b->hdr->heartbeat_ns, ccld_now_ns()); }

void ccld_set_step(ccld_board* b, int64_t step) {
  STORE(&b->hdr->step_start_ns, ccld_now_ns());
  STORE(&b->hdr->step, step);
}

void ccld_count_error(ccld_board* b) { __atomic_add_fetch(&b->hdr->errors, 1, __ATOMIC_RELAXED); }

void ccld_add_blocked(ccld_board* b, uint64_t ns) {
  __atomic_add_fetch(&b->hdr->blocked_ns, ns, __ATOMIC_RELAXED);
}

void ccld_set_clock_offset(ccld_board* b, int64_t offset_ns) {
  STORE(&b->hdr->clock_offset_ns, offset_ns);
}

int32_t ccld_channel_claim(ccld_board* b, uint8_t source) {
  ccld_channel* ch = ccld_board_channels(b);
  for (uint32_t i = 0; i < b->hdr->max_channels; i++) {
    uint32_t l = __atomic_load_n(&ch[i].lock, __ATOMIC_RELAXED);
    if ((l & 1u) || __atomic_load_n(&ch[i].source, __ATOMIC_RELAXED) != CCLD_SRC_NONE) continue;
    if (!__atomic_compare_exchange_n(&ch[i].lock, &l, l + 1, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
      continue;
    if (ch[i].source != CCLD_SRC_NONE) {
      write_end(&ch[i].lock, l);
      continue;
    }
    ch[i].source = source;
    write_end(&ch[i].lock, l);
    return (int32_t)i;
  }
  return -1;
}

void ccld_channel_write(ccld_board* b, int32_t slot, const ccld_channel* rec) {
  if (slot < 0 || (uint32_t)slot >= b->hdr->max_channels) return;
  ccld_channel* c = &ccld_board_channels(b)[slot];
  uint32_t l = write_begin(&c->lock);
  uint8_t source = c->source;
  memcpy((char*)c + sizeof(uint32_t), (const char*)rec + sizeof(uint32_t),
         sizeof(*c) - sizeof(uint32_t));
  c->source = source; /* the slot keeps the source that claimed it */
  write_end(&c->lock, l);
}

void ccld_channel_release(ccld_board* b, int32_t slot) {
  if (slot < 0 || (uint32_t)slot >= b->hdr->max_channels) return;
  ccld_channel* c = &ccld_board_channels(b)[slot];
  uint32_t l = write_begin(&c->lock);
  memset((char*)c + sizeof(uint32_t), 0, sizeof(*c) - sizeof(uint32_t));
  write_end(&c->lock, l);
}

int ccld_current_trace(uint64_t* group_id, uint64_t* seq, uint64_t* index) {
  if (!t_current.valid) return 0;
  if (group_id) *group_id = t_current.group_id;
  if (seq) *seq = t_current.seq;
  if (index) *index = t_current.index;
  return 1;
}

void ccld_clear_current_trace(void) { t_current.valid = 0; }

uint32_t ccld_copy_records(const void* src, void* dst, uint32_t count, uint32_t record_size) {
  uint32_t good = 0;
  for (uint32_t i = 0; i < count; i++) {
    const char* s = (const char*)src + (size_t)i * record_size;
    char* d = (char*)dst + (size_t)i * record_size;
    const uint32_t* lock = (const uint32_t*)s;
    int ok = 0;
    for (int attempt = 0; attempt < 64 && !ok; attempt++) {
      uint32_t l1 = __atomic_load_n(lock, __ATOMIC_ACQUIRE);
      if (l1 & 1u) continue;
      memcpy(d, s, record_size);
      __atomic_thread_fence(__ATOMIC_ACQUIRE);
      uint32_t l2 = __atomic_load_n(lock, __ATOMIC_RELAXED);
      if (l1 == l2) {
        memcpy(d, &l1, sizeof(l1));
        ok = 1;
      }
    }
    if (ok) {
      good++;
    } else {
      uint32_t torn = 1;
      memcpy(d, &torn, sizeof(torn));
    }
  }
  return good;
}
