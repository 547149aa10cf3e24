"""The board's enums, in one Python place: op codes, op states, op flags, channel sources,
directions and wait states.

They mirror the enums of ``csrc/board.h``; the native extension exports the same values
(``_native.layout()["codes"]``) and a native test checks that the two agree. The agent
writes these codes into summaries and the diagnoser reads them, so they are part of the
wire format: no torch, no native module here.
"""

from __future__ import annotations

__all__ = [
    "CHANNEL_TOTAL",
    "DIRECTION_NAMES",
    "DIRECTION_RECV",
    "DIRECTION_SEND",
    "FLAG_ASYNC",
    "FLAG_CUDA",
    "FLAG_DEVICE",
    "FLAG_P2P",
    "FLAG_SEND",
    "OP_CODES",
    "OP_NAMES",
    "SOURCE_NAMES",
    "SOURCE_NCCL",
    "SOURCE_NONE",
    "SOURCE_TCP",
    "STATE_DONE",
    "STATE_EMPTY",
    "STATE_ERROR",
    "STATE_IN_FLIGHT",
    "STATE_NAMES",
    "TIME_EVENTS",
    "TIME_HOST",
    "TIME_NAMES",
    "TIME_POLL",
    "TIME_PROFILER",
    "TIME_WORK",
    "WAIT_CODES",
    "WAIT_LOCAL",
    "WAIT_NAMES",
    "WAIT_NETWORK",
    "WAIT_NONE",
    "WAIT_PEER",
    "wait_name",
]

# enum ccld_op
OP_NAMES: dict[int, str] = {
    0: "unknown",
    1: "all_reduce",
    2: "all_gather",
    3: "all_gather_into_tensor",
    4: "reduce_scatter",
    5: "reduce_scatter_tensor",
    6: "broadcast",
    7: "reduce",
    8: "all_to_all",
    9: "all_to_all_single",
    10: "barrier",
    11: "send",
    12: "recv",
    13: "isend",
    14: "irecv",
    15: "batch_isend_irecv",
    16: "coalesced",
    17: "gather",
    18: "scatter",
    19: "_all_gather_base",
    20: "_reduce_scatter_base",
    21: "all_reduce_coalesced",
    22: "all_gather_coalesced",
    23: "monitored_barrier",
    24: "all_gather_single",
    25: "reduce_scatter_single",
}
OP_CODES: dict[str, int] = {v: k for k, v in OP_NAMES.items()}

# enum ccld_op_state
STATE_EMPTY, STATE_IN_FLIGHT, STATE_DONE, STATE_ERROR = 0, 1, 2, 3
STATE_NAMES = {
    STATE_EMPTY: "empty",
    STATE_IN_FLIGHT: "in_flight",
    STATE_DONE: "done",
    STATE_ERROR: "error",
}

# enum ccld_op_flags
FLAG_ASYNC, FLAG_P2P, FLAG_SEND, FLAG_CUDA, FLAG_DEVICE = 1, 2, 4, 8, 16

# enum ccld_time_source: where an op's device times come from, best first; 0 on the board
# is "no device time", and in a summary "host clocks" (a CPU job, or no device timeline)
TIME_HOST, TIME_PROFILER, TIME_EVENTS, TIME_WORK, TIME_POLL = 0, 1, 2, 3, 4
TIME_NAMES = {
    TIME_HOST: "host",
    TIME_PROFILER: "nccl-profiler",
    TIME_EVENTS: "device-events",
    TIME_WORK: "work-timing",
    TIME_POLL: "host-poll",
}

# enum ccld_channel_source
SOURCE_NONE, SOURCE_NCCL, SOURCE_TCP = 0, 1, 2
SOURCE_NAMES = {SOURCE_NONE: "none", SOURCE_NCCL: "nccl", SOURCE_TCP: "tcp"}

# enum ccld_direction
DIRECTION_SEND, DIRECTION_RECV = 0, 1
DIRECTION_NAMES = ("send", "recv")

# enum ccld_wait: what a channel's oldest pending step (or a connection) waits on
WAIT_NONE, WAIT_LOCAL, WAIT_PEER, WAIT_NETWORK = "none", "local", "peer", "network"
WAIT_NAMES = (WAIT_NONE, WAIT_LOCAL, WAIT_PEER, WAIT_NETWORK)
WAIT_CODES = {name: code for code, name in enumerate(WAIT_NAMES)}

# channel_id of an NCCL per-link totals record
CHANNEL_TOTAL = 0xFF


def wait_name(code: int, unknown: str = "none") -> str:
    """The name of a wait code read from a board or a summary (``unknown`` if out of range)."""
    return WAIT_NAMES[code] if 0 <= code < len(WAIT_NAMES) else unknown
