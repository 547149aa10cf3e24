/* Per-link totals of the NCCL profiler plugin (internal to the library).
 *
 * A channel record of the board lives only while its collective is in flight, so an agent
 * that samples once a second sees few of them. When a record's last proxy op stops, the
 * plugin folds it into one persistent record per (communicator, peer, direction), with
 * channel_id CCLD_CHANNEL_TOTAL: steps and bytes done, and how long steps spent waiting in
 * each state (CCLD_CHANNEL_TOTAL records reuse three TCP-only fields for that, see board.h).
 * The agent's deltas of these give each link's time in network wait per byte over a window,
 * which names a slow link. */
#ifndef CCLD_NCCL_LINKS_H
#define CCLD_NCCL_LINKS_H

#include <stdint.h>

#include "board.h"

/* Add a finished record (`rec`, with `wait_ns` indexed by enum ccld_wait) to the totals of
 * (comm, comm_gen, local_peer, rec->direction) on board b. Returns 0, or -1 when the link
 * table or the board's channel table is full (nothing recorded). Thread-safe. */
int ccld_link_add(ccld_board* b, const void* comm, uint32_t comm_gen, int32_t local_peer,
                  const ccld_channel* rec, const uint64_t wait_ns[4]);

/* Take the totals of a finalized communicator off the board. */
void ccld_link_drop_comm(const void* comm);

#endif
