/* The NCCL profiler plugin interface, versions 4, 5 and 6, declared from our fact sheet
 * (shared/reference/nccl-profiler-abi.md) so that the probe builds without NCCL headers.
 *
 * This is a binary contract with a library we do not compile against: field order, field
 * types and the order of the function pointers must match NCCL exactly. Our names are our
 * own (prefix ccld_nccl_) so the header can sit beside NCCL's without clashing; only the
 * exported symbols (ncclProfiler_v4/v5/v6) carry NCCL's names. nccl_profiler.c checks the
 * LP64 offsets that matter with static asserts.
 *
 * What changed between versions, for the fields we use:
 *   v4 -> v5: descriptor `type` widens from uint8_t to uint64_t (parentObj stays at offset 8
 *             because of alignment); coll/p2p gain a trailing `parentGroup`; the API event
 *             types appear; init takes a commId before the mask instead of a commHash after
 *             the name.
 *   v5 -> v6: copy-engine (Ce*) events and descriptors; everything else is unchanged.
 */
#ifndef CCLD_NCCL_PROFILER_ABI_H
#define CCLD_NCCL_PROFILER_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ncclResult_t: a C enum, int-sized. Only init may return non-zero. */
typedef enum {
  CCLD_NCCL_SUCCESS = 0,
  CCLD_NCCL_UNHANDLED_CUDA_ERROR = 1,
  CCLD_NCCL_SYSTEM_ERROR = 2,
  CCLD_NCCL_INTERNAL_ERROR = 3,
  CCLD_NCCL_INVALID_ARGUMENT = 4,
  CCLD_NCCL_INVALID_USAGE = 5,
  CCLD_NCCL_REMOTE_ERROR = 6,
} ccld_nccl_result_t;

/* Logger handed to init. `level` is NCCL's debug level enum. */
enum {
  CCLD_NCCL_LOG_NONE = 0,
  CCLD_NCCL_LOG_VERSION = 1,
  CCLD_NCCL_LOG_WARN = 2,
  CCLD_NCCL_LOG_INFO = 3,
  CCLD_NCCL_LOG_ABORT = 4,
  CCLD_NCCL_LOG_TRACE = 5,
};
typedef void (*ccld_nccl_logger_t)(int level, unsigned long flags, const char* file, int line,
                                   const char* fmt, ...);

/* Event types: bits of the activation mask and values of descriptor.type. */
enum {
  CCLD_NCCL_EV_GROUP = 1 << 0,
  CCLD_NCCL_EV_COLL = 1 << 1,
  CCLD_NCCL_EV_P2P = 1 << 2,
  CCLD_NCCL_EV_PROXY_OP = 1 << 3,
  CCLD_NCCL_EV_PROXY_STEP = 1 << 4,
  CCLD_NCCL_EV_PROXY_CTRL = 1 << 5,
  CCLD_NCCL_EV_KERNEL_CH = 1 << 6,
  CCLD_NCCL_EV_NET_PLUGIN = 1 << 7,
  CCLD_NCCL_EV_GROUP_API = 1 << 8,     /* v5+ */
  CCLD_NCCL_EV_COLL_API = 1 << 9,      /* v5+ */
  CCLD_NCCL_EV_P2P_API = 1 << 10,      /* v5+ */
  CCLD_NCCL_EV_KERNEL_LAUNCH = 1 << 11, /* v5+ */
  CCLD_NCCL_EV_CE_COLL = 1 << 12,      /* v6 */
  CCLD_NCCL_EV_CE_SYNC = 1 << 13,      /* v6 */
  CCLD_NCCL_EV_CE_BATCH = 1 << 14,     /* v6 */
};

/* Values of eState in recordEventState. 0-7 (old ProxyOp states) are deprecated from v4. */
enum {
  CCLD_NCCL_STATE_SEND_GPU_WAIT = 8,   /* send step: local GPU has not produced the data */
  CCLD_NCCL_STATE_SEND_WAIT = 9,       /* send step: posted to the network */
  CCLD_NCCL_STATE_RECV_WAIT = 10,      /* recv step: posted, data not arrived */
  CCLD_NCCL_STATE_RECV_FLUSH_WAIT = 11, /* recv step: waiting for the GPU-direct flush */
  CCLD_NCCL_STATE_RECV_GPU_WAIT = 12,  /* recv step: local GPU has not consumed the data */
  CCLD_NCCL_STATE_PROXY_CTRL_IDLE = 13,
  CCLD_NCCL_STATE_PROXY_CTRL_ACTIVE = 14,
  CCLD_NCCL_STATE_PROXY_CTRL_SLEEP = 15,
  CCLD_NCCL_STATE_PROXY_CTRL_WAKEUP = 16,
  CCLD_NCCL_STATE_PROXY_CTRL_APPEND = 17,
  CCLD_NCCL_STATE_PROXY_CTRL_APPEND_END = 18,
  CCLD_NCCL_STATE_PROXY_OP_IN_PROGRESS = 19, /* v4+ */
  CCLD_NCCL_STATE_SEND_PEER_WAIT = 20,       /* v4+: send step waits for the peer's credit */
  CCLD_NCCL_STATE_NET_PLUGIN_UPDATE = 21,
  CCLD_NCCL_STATE_KERNEL_CH_STOP = 22,
  CCLD_NCCL_STATE_GROUP_START_API_STOP = 23, /* v5+ */
  CCLD_NCCL_STATE_GROUP_END_API_START = 24,  /* v5+ */
  CCLD_NCCL_STATE_CE_COLL_START = 25,        /* v6: 25-30 copy-engine start/complete */
  CCLD_NCCL_STATE_CE_COLL_COMPLETE = 26,
  CCLD_NCCL_STATE_CE_SYNC_START = 27,
  CCLD_NCCL_STATE_CE_SYNC_COMPLETE = 28,
  CCLD_NCCL_STATE_CE_BATCH_START = 29,
  CCLD_NCCL_STATE_CE_BATCH_COMPLETE = 30,
};

/* Union members shared by all three versions (same layout everywhere). */
struct ccld_nccl_proxy_op {
  pid_t pid; /* process that created the op: not ours under PXN */
  uint8_t channelId;
  int peer; /* communicator-local rank of the remote end */
  int nSteps;
  int chunkSize;
  int isSend;
};
struct ccld_nccl_proxy_step {
  int step;
};
struct ccld_nccl_kernel_ch {
  uint8_t channelId;
  uint64_t pTimer; /* GPU global timer at start, ns */
};
struct ccld_nccl_net_plugin {
  int64_t id;
  void* data;
};

/* Coll and P2p without the v5 trailer: the v4 members. */
struct ccld_nccl_coll_v4 {
  uint64_t seqNumber;
  const char* func;
  const void* sendBuff;
  void* recvBuff;
  size_t count;
  int root;
  const char* datatype;
  uint8_t nChannels;
  uint8_t nWarps;
  const char* algo;
  const char* proto;
};
struct ccld_nccl_p2p_v4 {
  const char* func;
  void* buff;
  const char* datatype;
  size_t count;
  int peer; /* communicator-local */
  uint8_t nChannels;
};
struct ccld_nccl_coll_v5 {
  uint64_t seqNumber;
  const char* func;
  const void* sendBuff;
  void* recvBuff;
  size_t count;
  int root;
  const char* datatype;
  uint8_t nChannels;
  uint8_t nWarps;
  const char* algo;
  const char* proto;
  void* parentGroup;
};
struct ccld_nccl_p2p_v5 {
  const char* func;
  void* buff;
  const char* datatype;
  size_t count;
  int peer;
  uint8_t nChannels;
  void* parentGroup;
};
struct ccld_nccl_group_api {
  bool graphCaptured;
  int groupDepth;
};
struct ccld_nccl_coll_api {
  const char* func;
  size_t count;
  const char* datatype;
  int root;
  void* stream;
  bool graphCaptured;
};
struct ccld_nccl_p2p_api {
  const char* func;
  size_t count;
  const char* datatype;
  void* stream;
  bool graphCaptured;
};
struct ccld_nccl_kernel_launch {
  void* stream;
};
struct ccld_nccl_ce_coll {
  uint64_t seqNumber;
  const char* func;
  const void* sendBuff;
  void* recvBuff;
  size_t count;
  int root;
  const char* datatype;
  const char* syncStrategy;
  bool intraBatchSync;
  uint32_t batchSize;
  uint32_t numBatches;
  uint32_t ceSeqNum;
  void* stream;
};
struct ccld_nccl_ce_coll_sync {
  bool isComplete;
  int nRanks;
};
struct ccld_nccl_ce_coll_batch {
  int numOps;
  size_t totalBytes;
  bool useIntraSync;
};

/* Event descriptors (argument of startEvent): a common head, then a union. */
typedef struct {
  uint8_t type;
  void* parentObj; /* parent event's handle; foreign under PXN (never dereference then) */
  int rank;        /* communicator-local rank that raised the event */
  union {
    struct ccld_nccl_coll_v4 coll;
    struct ccld_nccl_p2p_v4 p2p;
    struct ccld_nccl_proxy_op proxyOp;
    struct ccld_nccl_proxy_step proxyStep;
    struct ccld_nccl_kernel_ch kernelCh;
    struct ccld_nccl_net_plugin netPlugin;
  };
} ccld_nccl_descr_v4_t;

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    struct ccld_nccl_group_api groupApi;
    struct ccld_nccl_coll_api collApi;
    struct ccld_nccl_p2p_api p2pApi;
    struct ccld_nccl_kernel_launch kernelLaunch;
    struct ccld_nccl_coll_v5 coll;
    struct ccld_nccl_p2p_v5 p2p;
    struct ccld_nccl_proxy_op proxyOp;
    struct ccld_nccl_proxy_step proxyStep;
    struct ccld_nccl_kernel_ch kernelCh;
    struct ccld_nccl_net_plugin netPlugin;
  };
} ccld_nccl_descr_v5_t;

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  union {
    struct ccld_nccl_group_api groupApi;
    struct ccld_nccl_coll_api collApi;
    struct ccld_nccl_p2p_api p2pApi;
    struct ccld_nccl_kernel_launch kernelLaunch;
    struct ccld_nccl_coll_v5 coll;
    struct ccld_nccl_p2p_v5 p2p;
    struct ccld_nccl_proxy_op proxyOp;
    struct ccld_nccl_proxy_step proxyStep;
    struct ccld_nccl_kernel_ch kernelCh;
    struct ccld_nccl_net_plugin netPlugin;
    struct ccld_nccl_ce_coll ceColl;
    struct ccld_nccl_ce_coll_sync ceCollSync;
    struct ccld_nccl_ce_coll_batch ceCollBatch;
  };
} ccld_nccl_descr_v6_t;

/* State arguments (argument of recordEventState); the same union in v4, v5 and v6. */
typedef union {
  struct {
    size_t transSize; /* bytes of the step's transfer */
  } proxyStep;
  struct {
    int appendedProxyOps;
  } proxyCtrl;
  struct {
    void* data;
  } netPlugin;
  struct {
    uint64_t pTimer; /* GPU global timer at KernelChStop */
  } kernelCh;
} ccld_nccl_state_args_t;

typedef ccld_nccl_state_args_t ccld_nccl_state_args_v4_t;
typedef ccld_nccl_state_args_t ccld_nccl_state_args_v5_t;
typedef ccld_nccl_state_args_t ccld_nccl_state_args_v6_t;

/* The exported plugin structs: a name, then five functions in this order. */
typedef struct {
  const char* name;
  ccld_nccl_result_t (*init)(void** context, int* eActivationMask, const char* commName,
                             uint64_t commHash, int nNodes, int nranks, int rank,
                             ccld_nccl_logger_t logfn);
  ccld_nccl_result_t (*startEvent)(void* context, void** eHandle, ccld_nccl_descr_v4_t* eDescr);
  ccld_nccl_result_t (*stopEvent)(void* eHandle);
  ccld_nccl_result_t (*recordEventState)(void* eHandle, int eState,
                                         ccld_nccl_state_args_v4_t* eStateArgs);
  ccld_nccl_result_t (*finalize)(void* context);
} ccld_nccl_profiler_v4_t;

typedef struct {
  const char* name;
  ccld_nccl_result_t (*init)(void** context, uint64_t commId, int* eActivationMask,
                             const char* commName, int nNodes, int nranks, int rank,
                             ccld_nccl_logger_t logfn);
  ccld_nccl_result_t (*startEvent)(void* context, void** eHandle, ccld_nccl_descr_v5_t* eDescr);
  ccld_nccl_result_t (*stopEvent)(void* eHandle);
  ccld_nccl_result_t (*recordEventState)(void* eHandle, int eState,
                                         ccld_nccl_state_args_v5_t* eStateArgs);
  ccld_nccl_result_t (*finalize)(void* context);
} ccld_nccl_profiler_v5_t;

typedef struct {
  const char* name;
  ccld_nccl_result_t (*init)(void** context, uint64_t commId, int* eActivationMask,
                             const char* commName, int nNodes, int nranks, int rank,
                             ccld_nccl_logger_t logfn);
  ccld_nccl_result_t (*startEvent)(void* context, void** eHandle, ccld_nccl_descr_v6_t* eDescr);
  ccld_nccl_result_t (*stopEvent)(void* eHandle);
  ccld_nccl_result_t (*recordEventState)(void* eHandle, int eState,
                                         ccld_nccl_state_args_v6_t* eStateArgs);
  ccld_nccl_result_t (*finalize)(void* context);
} ccld_nccl_profiler_v6_t;

/* The symbols NCCL looks up (newest first). Defined in nccl_profiler.c. */
extern const ccld_nccl_profiler_v4_t ncclProfiler_v4;
extern const ccld_nccl_profiler_v5_t ncclProfiler_v5;
extern const ccld_nccl_profiler_v6_t ncclProfiler_v6;

/* --- Not part of NCCL's interface: introspection of our plugin, for tests and tools. --- */

/* Counters since the library was loaded (or since ccld_nccl_stats_reset), and two gauges. */
typedef struct {
  uint64_t comms;          /* communicators initialized */
  uint64_t traced;         /* Coll/P2p (v4) or CollApi/P2pApi (v5+) bound to a trace id */
  uint64_t untraced;       /* ... with no trace id on the calling thread */
  uint64_t trace_mismatch; /* ... whose trace names another group than the comm's: ignored */
  uint64_t foreign_ops;    /* ProxyOps raised for another process (PXN) */
  uint64_t dropped;        /* events not tracked: a pool or the board's channel table full */
  uint64_t no_board;       /* events seen while the process had no board */
  uint64_t live_events;    /* gauge: ProxyOp/ProxyStep/KernelCh handles not yet stopped */
  uint64_t live_channels;  /* gauge: channel records this plugin holds on the board */
} ccld_nccl_stats_t;

void ccld_nccl_stats(ccld_nccl_stats_t* out);
void ccld_nccl_stats_reset(void);

/* The group a communicator (v4 commHash / v5+ commId) is bound to, learned from the first
 * traced Coll/P2p on it. Returns 1 and sets *group_id when bound, 0 otherwise. */
int ccld_nccl_comm_group(uint64_t comm_id, uint64_t* group_id);

/* Every live communicator: up to `max` (comm id, group id or 0 when not bound yet) pairs
 * written to the arrays; returns how many there are (for a check that cannot know the
 * ids NCCL chose). */
int ccld_nccl_comms(uint64_t* comm_ids, uint64_t* group_ids, int max);

#ifdef __cplusplus
}
#endif
#endif
