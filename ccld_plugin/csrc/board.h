/* The board: one memory-mapped file per rank that records what the rank is doing.
 *
 * The layout is defined here and nowhere else. The Python reader derives its numpy
 * dtypes from the offsets that the extension exports (ccld_layout_*), and a test checks
 * that both agree. Writers are lock-free: every record that can change after it is
 * published carries a seqlock word (odd while a write is in progress), so a reader in
 * another process never returns a torn record, even if the writer was killed mid-write.
 *
 * No dependency on Python or libtorch: the NCCL profiler plugin and the TCP probe write
 * to the same board from their own threads.
 */
#ifndef CCLD_BOARD_H
#define CCLD_BOARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CCLD_BOARD_MAGIC 0x445241424C444343ULL /* "CCLDBARD" little-endian */
#define CCLD_BOARD_VERSION 2u /* 2: device times on op records */
#define CCLD_NO_RANK (-1)
/* channel_id of an NCCL record that totals one (comm, peer, direction) since it began */
#define CCLD_CHANNEL_TOTAL 0xFF

/* Op codes of the collective tracer. Stable: they are written to board files. */
enum ccld_op {
  CCLD_OP_UNKNOWN = 0,
  CCLD_OP_ALL_REDUCE = 1,
  CCLD_OP_ALL_GATHER = 2,
  CCLD_OP_ALL_GATHER_INTO_TENSOR = 3,
  CCLD_OP_REDUCE_SCATTER = 4,
  CCLD_OP_REDUCE_SCATTER_TENSOR = 5,
  CCLD_OP_BROADCAST = 6,
  CCLD_OP_REDUCE = 7,
  CCLD_OP_ALL_TO_ALL = 8,
  CCLD_OP_ALL_TO_ALL_SINGLE = 9,
  CCLD_OP_BARRIER = 10,
  CCLD_OP_SEND = 11,
  CCLD_OP_RECV = 12,
  CCLD_OP_ISEND = 13,
  CCLD_OP_IRECV = 14,
  CCLD_OP_BATCH_P2P = 15,
  CCLD_OP_COALESCED = 16,
  CCLD_OP_GATHER = 17,
  CCLD_OP_SCATTER = 18,
  CCLD_OP_ALL_GATHER_BASE = 19,
  CCLD_OP_REDUCE_SCATTER_BASE = 20,
  CCLD_OP_ALL_REDUCE_COALESCED = 21,
  CCLD_OP_ALL_GATHER_COALESCED = 22,
  CCLD_OP_MONITORED_BARRIER = 23,
  CCLD_OP_ALL_GATHER_SINGLE = 24,
  CCLD_OP_REDUCE_SCATTER_SINGLE = 25,
};

/* State of an op record. */
enum ccld_op_state {
  CCLD_STATE_EMPTY = 0,
  CCLD_STATE_IN_FLIGHT = 1,
  CCLD_STATE_DONE = 2,
  CCLD_STATE_ERROR = 3,
};

/* Op record flags. */
enum ccld_op_flags {
  CCLD_FLAG_ASYNC = 1u << 0,
  CCLD_FLAG_P2P = 1u << 1,  /* seq counts per (group, peer, direction); peer is valid */
  CCLD_FLAG_SEND = 1u << 2, /* with P2P: this rank sends */
  CCLD_FLAG_CUDA = 1u << 3, /* exit is stamped by the completion poller */
  /* the device timeline follows this op: its dev_* times come when the device reaches it
   * and when it finishes it there (an op in flight with no dev_start_ns: not reached yet) */
  CCLD_FLAG_DEVICE = 1u << 4,
};

/* Where an op record's device times come from, best first (a record keeps, per time, the
 * best source that gave it): the NCCL profiler plugin's kernel-channel GPU clocks, timing
 * events recorded on the op's stream, the process group's own work timing (start plus
 * duration), the host time a poller saw the work complete. */
enum ccld_time_source {
  CCLD_TIME_NONE = 0,
  CCLD_TIME_PROFILER = 1,
  CCLD_TIME_EVENTS = 2,
  CCLD_TIME_WORK = 3,
  CCLD_TIME_POLL = 4,
};

/* Who filled a channel record, and what it is waiting on. */
enum ccld_channel_source { CCLD_SRC_NONE = 0, CCLD_SRC_NCCL = 1, CCLD_SRC_TCP = 2 };
enum ccld_direction { CCLD_DIR_SEND = 0, CCLD_DIR_RECV = 1 };
enum ccld_wait {
  CCLD_WAIT_NONE = 0,    /* progressing, or nothing pending */
  CCLD_WAIT_LOCAL = 1,   /* waiting for the local device / process */
  CCLD_WAIT_PEER = 2,    /* waiting for the peer (credit, receiver not reading) */
  CCLD_WAIT_NETWORK = 3, /* posted to the network, waiting for it */
};

typedef struct ccld_header {
  uint64_t magic;
  uint32_t version;
  uint32_t header_size;
  uint64_t file_size;
  int32_t rank;
  int32_t world;
  int32_t pid;
  uint32_t ring_size; /* power of two */
  uint32_t max_groups;
  uint32_t max_channels;
  uint32_t rank_pool_size; /* int32 entries */
  uint32_t groups_off;     /* byte offsets of the tables from the file start */
  uint32_t ring_off;
  uint32_t channels_off;
  uint32_t rank_pool_off;
  uint32_t _pad0;
  int64_t start_wall_ns; /* CLOCK_REALTIME at creation */
  int64_t start_mono_ns; /* CLOCK_MONOTONIC at creation; every other time is monotonic */
  char host[64];
  char job[64];
  /* Fields below change while the rank runs. */
  uint64_t num_groups;      /* published with release order after the group is written */
  uint64_t rank_pool_used;
  uint64_t ops_written;     /* op records ever started; next ring index */
  int64_t heartbeat_ns;     /* agent heartbeat */
  int64_t step;             /* current training step, copied into each op */
  int64_t step_start_ns;
  uint64_t errors;          /* errors contained inside the plugin */
  int64_t clock_offset_ns;  /* this rank's monotonic clock minus the diagnoser's */
  uint64_t closed;          /* 1 after a clean close */
  uint64_t blocked_ns;      /* time spent inside synchronous ops and waits on async ones */
  uint8_t _reserved[112];
} ccld_header;

typedef struct ccld_group {
  uint64_t group_id;      /* stable hash of the sorted global ranks */
  int32_t role;           /* index into the role list of the Python topology */
  int32_t size;
  uint32_t ranks_off;     /* index into the rank pool (int32 global ranks) */
  int32_t my_index;       /* this rank's index in the group */
  uint64_t entered_seq;   /* seq of the last collective entered (0: none) */
  uint64_t completed_seq; /* highest seq completed */
  int64_t last_enter_ns;
  int64_t last_exit_ns;
  uint64_t _reserved;
} ccld_group;

typedef struct ccld_op_record {
  uint32_t lock; /* seqlock: odd while being written */
  uint16_t op;
  uint8_t state;
  uint8_t flags;
  uint16_t group_slot;
  uint8_t dev_source; /* ccld_time_source of dev_start_ns (low nibble) and dev_end_ns (high) */
  uint8_t _pad;
  uint32_t index_lo; /* low bits of the ring index: tells a late exit from a reused slot */
  int32_t peer;      /* global rank of the P2P peer; CCLD_NO_RANK for collectives */
  int32_t step;
  uint64_t group_id;
  uint64_t seq;
  uint64_t bytes;
  int64_t enter_ns;
  int64_t exit_ns;
  /* Ops flagged CCLD_FLAG_DEVICE: when the device reached the op and when it finished it
   * there, mapped to this board's monotonic clock (0: not known yet), and the error of
   * that mapping (saturated at 2^32-1 ns). */
  int64_t dev_start_ns;
  int64_t dev_end_ns;
  uint32_t dev_err_ns;
  uint32_t _pad2;
} ccld_op_record;

typedef struct ccld_channel {
  uint32_t lock; /* seqlock */
  uint8_t source;
  uint8_t direction;
  uint8_t wait;
  uint8_t channel_id;
  int32_t peer; /* global rank of the peer, or CCLD_NO_RANK */
  uint32_t pid; /* process that raised the events (PXN), or 0 */
  uint64_t group_id;
  uint64_t seq;
  uint64_t steps_posted;
  uint64_t steps_done;
  uint64_t bytes_done;   /* bytes moved (TCP: bytes acked / received) */
  uint64_t bytes_queued; /* bytes waiting (TCP: unsent + unacked) */
  int64_t first_ns;
  int64_t last_progress_ns;
  uint32_t rtt_us;
  uint32_t retrans;
  /* TCP: from tcp_info. NCCL totals records (channel_id CCLD_CHANNEL_TOTAL): the time the
   * link's steps spent waiting on the peer's credit, on the local GPU, on the network. */
  uint64_t rwnd_limited_us;
  uint64_t sndbuf_limited_us;
  uint64_t busy_us;
  uint64_t delivery_rate; /* bytes per second */
  uint16_t local_port;
  uint16_t remote_port;
  uint32_t remote_addr; /* IPv4, network order; 0 for IPv6 or unknown */
} ccld_channel;

typedef struct ccld_board ccld_board; /* opaque handle of a mapped board */

/* Sizes of a board with these capacities. ring_size is rounded up to a power of two. */
size_t ccld_board_size(uint32_t ring_size, uint32_t max_groups, uint32_t max_channels,
                       uint32_t rank_pool_size);

/* Create (or empty) and map a board file, never through a symbolic link, with its pages
 * reserved (ENOSPC when the folder has no room for them). Returns NULL and sets errno on
 * failure. The first board created in a process becomes the process board
 * (ccld_process_board). */
ccld_board* ccld_board_create(const char* path, int32_t rank, int32_t world, const char* job,
                              const char* host, uint32_t ring_size, uint32_t max_groups,
                              uint32_t max_channels, uint32_t rank_pool_size);
/* Unmap; unlink the file when `unlink_file` is non-zero. */
void ccld_board_close(ccld_board* b, int unlink_file);
ccld_board* ccld_process_board(void);
ccld_header* ccld_board_header(ccld_board* b);
ccld_group* ccld_board_group(ccld_board* b, uint32_t slot);
ccld_channel* ccld_board_channels(ccld_board* b);

/* Register a group; returns its slot, or -1 when the group table or rank pool is full.
 * Registering the same group_id again returns the existing slot. */
int32_t ccld_group_register(ccld_board* b, uint64_t group_id, int32_t role, const int32_t* ranks,
                            int32_t size, int32_t my_index);

/* Change the role of a registered group (a user registration refines an automatic one). */
void ccld_group_set_role(ccld_board* b, uint32_t slot, int32_t role);

/* Start an op record. seq == 0 assigns the group's next collective seq; P2P ops pass the
 * seq they counted per (peer, direction). Also sets the calling thread's current trace id.
 * Returns the ring index of the record (monotonic; the slot is index & (ring_size-1)). */
uint64_t ccld_op_enter(ccld_board* b, uint32_t group_slot, uint16_t op, uint8_t flags,
                       uint64_t bytes, int32_t peer, uint64_t seq);
/* Finish an op record started by ccld_op_enter; a no-op if the ring has wrapped past it. */
void ccld_op_exit(ccld_board* b, uint64_t index, uint8_t state);
/* Add bytes to an in-flight record (coalesced ops learn their size while they run). */
void ccld_op_add_bytes(ccld_board* b, uint64_t index, uint64_t bytes);
/* Set the device times of a record from `source` (ccld_time_source): a time of 0 is left
 * as it is, a time already given by a better source is kept, and of the same source the
 * earliest start and the latest end are kept. A no-op if the ring has wrapped past the
 * record. */
void ccld_op_set_device(ccld_board* b, uint64_t index, uint8_t source, int64_t start_ns,
                        int64_t end_ns, uint32_t err_ns);

void ccld_heartbeat(ccld_board* b);
void ccld_set_step(ccld_board* b, int64_t step);
void ccld_count_error(ccld_board* b);
/* Add time the training loop spent blocked on async work (a wait() call). */
void ccld_add_blocked(ccld_board* b, uint64_t ns);
void ccld_set_clock_offset(ccld_board* b, int64_t offset_ns);

/* Channel records: claim a free slot for a source, write it, release it. */
int32_t ccld_channel_claim(ccld_board* b, uint8_t source);
void ccld_channel_write(ccld_board* b, int32_t slot, const ccld_channel* rec);
void ccld_channel_release(ccld_board* b, int32_t slot);

/* The calling thread's current trace id: set by ccld_op_enter, read by the NCCL profiler
 * plugin inside the collective call. Returns 0 when the thread has none. */
int ccld_current_trace(uint64_t* group_id, uint64_t* seq, uint64_t* index);
void ccld_clear_current_trace(void);

/* Seqlock-consistent copy of `count` records of `record_size` bytes (each starting with a
 * 32-bit lock word). A record still being written after a few retries is copied with its
 * lock word set to 1 (odd) so that the reader can drop it. Returns the number of
 * consistent records. */
uint32_t ccld_copy_records(const void* src, void* dst, uint32_t count, uint32_t record_size);

int64_t ccld_now_ns(void); /* CLOCK_MONOTONIC */

#ifdef __cplusplus
}
#endif
#endif
