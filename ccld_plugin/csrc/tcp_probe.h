/* TCP transport probe: the counters the kernel keeps for this process's TCP connections.
 *
 * gloo, the NCCL socket transport and the TCPStore move their bytes over plain TCP. The
 * kernel already measures, per connection, how much was acknowledged, how much is still
 * queued, the RTT, retransmissions, and (the key to attribution) how long the sender was
 * stalled by the peer's receive window or by its own send buffer. This probe reads those
 * counters through NETLINK_SOCK_DIAG, either as a dump (one per address family; finds new
 * connections) or by exact lookup of known ones (much cheaper: see ccld_tcp_refresh),
 * keeps the sockets that belong to this process, and returns them as flat records.
 *
 * No allocation that outlives a call, no global state, no locks: safe to call from any
 * thread, and after fork. Each call opens and closes its own netlink socket, which costs
 * a few microseconds and removes every question about sharing one between threads.
 *
 * The record layout is plain C so that Python reads it with ctypes; ccld_tcp_conn_size()
 * lets the reader check that both sides agree.
 */
#ifndef CCLD_TCP_PROBE_H
#define CCLD_TCP_PROBE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* TCP states, Linux numbering (include/net/tcp_states.h). Bit masks are 1u << state. */
enum ccld_tcp_state {
  CCLD_TCP_ESTABLISHED = 1,
  CCLD_TCP_SYN_SENT = 2,
  CCLD_TCP_SYN_RECV = 3,
  CCLD_TCP_FIN_WAIT1 = 4,
  CCLD_TCP_FIN_WAIT2 = 5,
  CCLD_TCP_TIME_WAIT = 6,
  CCLD_TCP_CLOSE = 7,
  CCLD_TCP_CLOSE_WAIT = 8,
  CCLD_TCP_LAST_ACK = 9,
  CCLD_TCP_LISTEN = 10,
  CCLD_TCP_CLOSING = 11,
};

/* Every state in which a socket carries (or is about to carry) data for its owner.
 * CLOSE_WAIT is in: it is how a connection looks after the peer process died. TIME_WAIT
 * is out: those sockets have no owner (inode 0) and never match a process. */
#define CCLD_TCP_STATES_CONNECTED                                                         \
  ((1u << CCLD_TCP_ESTABLISHED) | (1u << CCLD_TCP_SYN_SENT) | (1u << CCLD_TCP_SYN_RECV) | \
   (1u << CCLD_TCP_FIN_WAIT1) | (1u << CCLD_TCP_FIN_WAIT2) | (1u << CCLD_TCP_CLOSE_WAIT) | \
   (1u << CCLD_TCP_LAST_ACK) | (1u << CCLD_TCP_CLOSING))
#define CCLD_TCP_STATES_LISTEN (1u << CCLD_TCP_LISTEN)

/* One connection as the kernel saw it at sample_ns. Counters are cumulative over the
 * connection's life: compare two samples of the same cookie to get rates and shares. */
typedef struct ccld_tcp_conn {
  uint64_t cookie;      /* kernel socket cookie: unique while the socket lives */
  int64_t sample_ns;    /* CLOCK_MONOTONIC when this sample was taken (same clock as board) */
  uint32_t inode;       /* the "socket:[inode]" of /proc/<pid>/fd */
  uint8_t family;       /* AF_INET (2) or AF_INET6 (10) */
  uint8_t state;        /* enum ccld_tcp_state */
  uint16_t info_bytes;  /* bytes of struct tcp_info the kernel returned; 0 = no tcp_info */
  uint8_t local_addr[16];  /* network byte order; IPv4 in the first 4 bytes */
  uint8_t remote_addr[16];
  uint16_t local_port;     /* host byte order */
  uint16_t remote_port;
  uint32_t ifindex;        /* interface the socket is bound to (0: none); part of its key */

  /* Progress. */
  uint64_t bytes_acked;    /* bytes the peer acknowledged (tcpi_bytes_acked) */
  uint64_t bytes_received; /* bytes received in order (tcpi_bytes_received) */
  uint64_t bytes_sent;     /* bytes sent, retransmissions included (tcpi_bytes_sent) */
  uint64_t bytes_retrans;  /* bytes retransmitted (tcpi_bytes_retrans) */

  /* Where time went while data was queued (microseconds, jiffy resolution). busy_us is
   * the whole time the write queue was non-empty and so includes the two below. */
  uint64_t busy_us;
  uint64_t rwnd_limited_us;   /* stalled: the peer's receive window was full */
  uint64_t sndbuf_limited_us; /* stalled: everything sent, but the send buffer was full */
  uint64_t delivery_rate;     /* bytes per second, last estimate (tcpi_delivery_rate) */

  /* Queues right now. */
  uint32_t notsent_bytes; /* written by the application, not yet sent */
  uint32_t unacked_bytes; /* sent, not yet acknowledged */
  uint32_t unread_bytes;  /* received, not yet read by the application */
  uint32_t unacked_segs;  /* tcpi_unacked */

  /* Path. */
  uint32_t rtt_us;        /* smoothed RTT */
  uint32_t rttvar_us;
  uint32_t min_rtt_us;    /* windowed minimum RTT: the path's floor */
  uint32_t total_retrans; /* segments retransmitted over the connection's life */
  uint32_t retrans_out;   /* retransmitted segments not yet acknowledged (tcpi_retrans) */
  uint32_t lost_segs;     /* segments presumed lost (tcpi_lost) */
  uint32_t rto_count;     /* consecutive retransmission timeouts (tcpi_retransmits) */
  uint32_t snd_cwnd;      /* congestion window, segments */
  uint32_t snd_mss;
  uint32_t snd_wnd;       /* peer's advertised receive window, bytes (0 before Linux 6.2) */
  uint32_t sndbuf_bytes;  /* SO_SNDBUF as the kernel holds it */
  uint32_t rcvbuf_bytes;  /* SO_RCVBUF as the kernel holds it */
  uint32_t last_data_sent_ms; /* ms since the last data was sent */
  uint32_t last_data_recv_ms; /* ms since the last data was received */
  uint32_t last_ack_recv_ms;  /* ms since the last ACK was received */
  uint32_t _pad1;
} ccld_tcp_conn;

/* sizeof(ccld_tcp_conn), for the Python reader's layout check. */
size_t ccld_tcp_conn_size(void);

/* Socket inodes of process `pid` (0: this process), read from /proc/<pid>/fd. For this
 * process only TCP sockets are listed (fstat and SO_PROTOCOL on the fd itself, cheaper
 * than resolving the /proc links); for another process every socket, since its fds cannot
 * be asked (the dump sorts them out). Writes up to max_out inodes to `out` and returns
 * how many were found (which may exceed max_out), or -errno. */
int ccld_tcp_socket_inodes(int pid, uint32_t* out, int max_out);

/* Sample the TCP sockets of the current network namespace whose inode is in
 * `inodes[0..n_inodes)` (any order), or, when `inodes` is NULL, the sockets of this
 * process (its /proc/self/fd is read in the same call). `states` is a mask of
 * 1u << ccld_tcp_state; 0 means CCLD_TCP_STATES_CONNECTED. IPv4 and IPv6 are both read.
 *
 * Writes up to max_out records and returns the number of matching sockets, which may
 * exceed max_out (call again with a larger buffer), or -errno on failure. Never blocks
 * longer than about a second, even if the kernel stops answering. */
int ccld_tcp_sample(const uint32_t* inodes, int n_inodes, uint32_t states, ccld_tcp_conn* out,
                    int max_out);

/* Re-read, in place, connections that an earlier ccld_tcp_sample returned, by exact
 * lookup of each socket's key (family, addresses, ports, interface, cookie). The cost
 * grows with n only, whereas every dump walks the kernel's whole TCP hash table (262,144
 * buckets on a 24 GiB host, more on large ones) however few sockets match. A caller that
 * knows its connections refreshes them and dumps only to discover new ones.
 *
 * Records whose socket is gone (closed, reset, or orphaned after close) are dropped and
 * the survivors moved to the front, in their original order. Returns how many survive,
 * or -errno; then nothing is dropped or moved, but records already re-read hold new
 * values. */
int ccld_tcp_refresh(ccld_tcp_conn* conns, int n);

#ifdef __cplusplus
}
#endif
#endif
