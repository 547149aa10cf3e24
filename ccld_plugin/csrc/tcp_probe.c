/* TCP transport probe: sock_diag dump of TCP sockets, filtered to one process's inodes. */
#define _GNU_SOURCE
#include "tcp_probe.h"

#include <dirent.h>
#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(ccld_tcp_conn) % 8 == 0, "ccld_tcp_conn must stay 8-byte aligned");

/* Dump batches are at most ~32 KiB on current kernels; 64 KiB leaves headroom, and
 * a buffer that is too small shows up as MSG_TRUNC (checked), never as silent loss. */
#define RECV_BUF_BYTES (64 * 1024)
/* A sample must never wedge the caller (the agent thread) if netlink stops answering. */
#define RECV_TIMEOUT_MS 1000
/* Initial capacity for the inode list when the probe reads /proc/self/fd itself. */
#define INITIAL_INODES 1024

size_t ccld_tcp_conn_size(void) { return sizeof(ccld_tcp_conn); }

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- /proc/<pid>/fd ------------------------------------------------------------------ */

int ccld_tcp_socket_inodes(int pid, uint32_t* out, int max_out) {
  int self = pid <= 0 || pid == (int)getpid();
  char path[64];
  if (self)
    snprintf(path, sizeof path, "/proc/self/fd");
  else
    snprintf(path, sizeof path, "/proc/%d/fd", pid);
  DIR* dir = opendir(path);
  if (!dir) return -errno;
  int dfd = dirfd(dir);
  int found = 0;
  struct dirent* de;
  char link[64];
  while ((de = readdir(dir)) != NULL) {
    if (de->d_name[0] == '.') continue;
    uint32_t ino;
    if (self) {
      /* Our own fds: fstat is several times cheaper than resolving the /proc link. An fd
       * closed or reused since readdir just reports what it is now, or fails. */
      int fd = atoi(de->d_name);
      struct stat st;
      if (fd == dfd || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
      /* Only TCP: Unix sockets come and go by the hundred in a process with data loader
       * workers (fd passing), and every unknown inode costs the caller a dump. */
      int proto = 0;
      socklen_t len = sizeof proto;
      if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &len) == 0 && proto != IPPROTO_TCP)
        continue;
      ino = (uint32_t)st.st_ino;
    } else {
      /* "socket:[12345]": 8 + up to 10 digits + 1. */
      ssize_t n = readlinkat(dfd, de->d_name, link, sizeof link - 1);
      if (n < 10 || memcmp(link, "socket:[", 8) != 0) continue;
      link[n] = '\0';
      char* end = NULL;
      unsigned long v = strtoul(link + 8, &end, 10);
      if (!end || *end != ']') continue;
      ino = (uint32_t)v;
    }
    if (found < max_out) out[found] = ino;
    found++;
  }
  closedir(dir);
  return found;
}

/* ---- netlink dump --------------------------------------------------------------------- */

static int cmp_u32(const void* a, const void* b) {
  uint32_t x = *(const uint32_t*)a, y = *(const uint32_t*)b;
  return (x > y) - (x < y);
}

static int has_inode(const uint32_t* sorted, int n, uint32_t ino) {
  int lo = 0, hi = n - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2;
    if (sorted[mid] == ino) return 1;
    if (sorted[mid] < ino) lo = mid + 1;
    else hi = mid - 1;
  }
  return 0;
}

static void fill_conn(ccld_tcp_conn* c, const struct inet_diag_msg* m, int attr_len,
                      int64_t now) {
  memset(c, 0, sizeof *c);
  c->sample_ns = now;
  c->cookie = ((uint64_t)m->id.idiag_cookie[1] << 32) | m->id.idiag_cookie[0];
  c->inode = m->idiag_inode;
  c->family = m->idiag_family;
  c->state = m->idiag_state;
  memcpy(c->local_addr, m->id.idiag_src, 16);
  memcpy(c->remote_addr, m->id.idiag_dst, 16);
  c->local_port = ntohs(m->id.idiag_sport);
  c->remote_port = ntohs(m->id.idiag_dport);
  c->ifindex = m->id.idiag_if;

  /* Older kernels return a shorter tcp_info, newer ones a longer one: copy what both
   * know and leave the rest zero. */
  struct tcp_info ti;
  memset(&ti, 0, sizeof ti);
  const struct rtattr* a = (const struct rtattr*)((const char*)m + NLMSG_ALIGN(sizeof *m));
  for (; RTA_OK(a, attr_len); a = RTA_NEXT(a, attr_len)) {
    size_t len = RTA_PAYLOAD(a);
    if (a->rta_type == INET_DIAG_INFO) {
      if (len > sizeof ti) len = sizeof ti;
      memcpy(&ti, RTA_DATA(a), len);
      c->info_bytes = (uint16_t)len;
    } else if (a->rta_type == INET_DIAG_SKMEMINFO && len >= SK_MEMINFO_SNDBUF * 4 + 4) {
      const uint32_t* mem = RTA_DATA(a);
      c->rcvbuf_bytes = mem[SK_MEMINFO_RCVBUF];
      c->sndbuf_bytes = mem[SK_MEMINFO_SNDBUF];
    }
  }

  c->bytes_acked = ti.tcpi_bytes_acked;
  c->bytes_received = ti.tcpi_bytes_received;
  c->bytes_sent = ti.tcpi_bytes_sent;
  c->bytes_retrans = ti.tcpi_bytes_retrans;
  c->busy_us = ti.tcpi_busy_time;
  c->rwnd_limited_us = ti.tcpi_rwnd_limited;
  c->sndbuf_limited_us = ti.tcpi_sndbuf_limited;
  c->delivery_rate = ti.tcpi_delivery_rate;
  c->notsent_bytes = ti.tcpi_notsent_bytes;
  c->unacked_segs = ti.tcpi_unacked;
  c->rtt_us = ti.tcpi_rtt;
  c->rttvar_us = ti.tcpi_rttvar;
  c->min_rtt_us = ti.tcpi_min_rtt;
  c->total_retrans = ti.tcpi_total_retrans;
  c->retrans_out = ti.tcpi_retrans;
  c->lost_segs = ti.tcpi_lost;
  c->rto_count = ti.tcpi_retransmits;
  c->snd_cwnd = ti.tcpi_snd_cwnd;
  c->snd_mss = ti.tcpi_snd_mss;
  c->snd_wnd = ti.tcpi_snd_wnd;
  c->last_data_sent_ms = ti.tcpi_last_data_sent;
  c->last_data_recv_ms = ti.tcpi_last_data_recv;
  c->last_ack_recv_ms = ti.tcpi_last_ack_recv;

  /* For a connected socket the kernel reports rqueue = rcv_nxt - copied_seq (received,
   * unread) and wqueue = write_seq - snd_una (written, unacknowledged, which includes
   * the part not sent yet). A listener reports its accept backlog there instead. */
  if (m->idiag_state != CCLD_TCP_LISTEN) {
    c->unread_bytes = m->idiag_rqueue;
    c->unacked_bytes =
        m->idiag_wqueue > c->notsent_bytes ? m->idiag_wqueue - c->notsent_bytes : 0;
  }
}

static int open_diag_socket(void) {
  int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return -errno;
  struct timeval tv = {.tv_sec = RECV_TIMEOUT_MS / 1000,
                       .tv_usec = (RECV_TIMEOUT_MS % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* Extensions asked for in every request: tcp_info and the socket's memory counters. */
#define REQUEST_EXT ((1u << (INET_DIAG_INFO - 1)) | (1u << (INET_DIAG_SKMEMINFO - 1)))

/* One dump for one address family. Appends matches to out[*count...]. Returns 0 or
 * -errno. */
static int dump_family(int fd, uint8_t family, uint32_t states, const uint32_t* inodes,
                       int n_inodes, ccld_tcp_conn* out, int max_out, int* count, char* buf,
                       int64_t now) {
  struct {
    struct nlmsghdr nlh;
    struct inet_diag_req_v2 req;
  } msg;
  memset(&msg, 0, sizeof msg);
  msg.nlh.nlmsg_len = sizeof msg;
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  msg.nlh.nlmsg_seq = family;
  msg.req.sdiag_family = family;
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = states;
  msg.req.idiag_ext = REQUEST_EXT;

  struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
  for (;;) {
    if (sendto(fd, &msg, sizeof msg, 0, (struct sockaddr*)&kernel, sizeof kernel) >= 0) break;
    if (errno != EINTR) return -errno;
  }

  for (;;) {
    struct iovec iov = {.iov_base = buf, .iov_len = RECV_BUF_BYTES};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    ssize_t got = recvmsg(fd, &mh, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN ? -ETIMEDOUT : -errno;
    }
    if (mh.msg_flags & MSG_TRUNC) return -EMSGSIZE;
    int len = (int)got;
    for (struct nlmsghdr* h = (struct nlmsghdr*)buf; NLMSG_OK(h, len); h = NLMSG_NEXT(h, len)) {
      if (h->nlmsg_seq != family) continue; /* not ours: cannot happen on a fresh socket */
      if (h->nlmsg_type == NLMSG_DONE) return 0;
      if (h->nlmsg_type == NLMSG_ERROR) {
        const struct nlmsgerr* e = NLMSG_DATA(h);
        return e->error ? e->error : -EPROTO;
      }
      if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) continue;
      const struct inet_diag_msg* m = NLMSG_DATA(h);
      if (h->nlmsg_len < NLMSG_LENGTH(sizeof *m)) continue;
      if (!has_inode(inodes, n_inodes, m->idiag_inode)) continue;
      if (*count < max_out) {
        int attr_len = (int)h->nlmsg_len - (int)NLMSG_LENGTH(NLMSG_ALIGN(sizeof *m));
        fill_conn(&out[*count], m, attr_len, now);
      }
      (*count)++;
    }
  }
}

int ccld_tcp_sample(const uint32_t* inodes, int n_inodes, uint32_t states, ccld_tcp_conn* out,
                    int max_out) {
  if (max_out < 0 || (inodes && n_inodes < 0)) return -EINVAL;
  if (states == 0) states = CCLD_TCP_STATES_CONNECTED;
  int64_t now = mono_ns();

  /* Our own sorted copy of the inode set: binary search per dumped socket. */
  uint32_t* set = NULL;
  int n = 0;
  if (inodes) {
    n = n_inodes;
    set = malloc(((size_t)n + 1) * sizeof *set);
    if (!set) return -ENOMEM;
    memcpy(set, inodes, (size_t)n * sizeof *set);
  } else {
    int cap = INITIAL_INODES;
    for (;;) {
      set = malloc((size_t)cap * sizeof *set);
      if (!set) return -ENOMEM;
      n = ccld_tcp_socket_inodes(0, set, cap);
      if (n < 0) {
        free(set);
        return n;
      }
      if (n <= cap) break;
      free(set); /* more fds than room: retry once the size is known, with headroom */
      cap = n + n / 4 + 16;
    }
  }
  qsort(set, (size_t)n, sizeof *set, cmp_u32);

  int rc = 0, count = 0;
  char* buf = NULL;
  int fd = -1;
  if (n == 0) goto done; /* no sockets at all: nothing can match */

  buf = malloc(RECV_BUF_BYTES);
  if (!buf) {
    rc = -ENOMEM;
    goto done;
  }
  fd = open_diag_socket();
  if (fd < 0) {
    rc = fd;
    goto done;
  }

  rc = dump_family(fd, AF_INET, states, set, n, out, max_out, &count, buf, now);
  if (rc == 0) {
    int rc6 = dump_family(fd, AF_INET6, states, set, n, out, max_out, &count, buf, now);
    /* A kernel without IPv6 has no inet6 diag handler: that is "no IPv6 sockets". */
    if (rc6 != -ENOENT && rc6 != -EAFNOSUPPORT && rc6 != -EINVAL) rc = rc6;
  }

done:
  if (fd >= 0) close(fd);
  free(buf);
  free(set);
  return rc < 0 ? rc : count;
}

/* ---- exact lookups ---------------------------------------------------------------------- */

/* Requests per sendmsg. Every reply is its own skb of 1-2 KiB of truesize, and replies
 * that do not fit the socket's receive buffer (about 200 KiB by default) are dropped by
 * the kernel, so a batch must stay well below that. */
#define REFRESH_BATCH 32

typedef struct {
  struct nlmsghdr nlh;
  struct inet_diag_req_v2 req;
} diag_request;

int ccld_tcp_refresh(ccld_tcp_conn* conns, int n) {
  if (n < 0 || (n > 0 && !conns)) return -EINVAL;
  if (n == 0) return 0;
  int64_t now = mono_ns();
  int rc = 0;
  diag_request* reqs = calloc(REFRESH_BATCH, sizeof *reqs);
  char* buf = malloc(RECV_BUF_BYTES);
  uint8_t* alive = calloc((size_t)n, 1);
  int fd = open_diag_socket();
  if (!reqs || !buf || !alive) rc = -ENOMEM;
  else if (fd < 0) rc = fd;

  for (int base = 0; rc == 0 && base < n; base += REFRESH_BATCH) {
    int m = n - base < REFRESH_BATCH ? n - base : REFRESH_BATCH;
    for (int i = 0; i < m; i++) {
      const ccld_tcp_conn* c = &conns[base + i];
      diag_request* r = &reqs[i];
      memset(r, 0, sizeof *r);
      r->nlh.nlmsg_len = sizeof *r;
      r->nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
      r->nlh.nlmsg_flags = NLM_F_REQUEST;
      r->nlh.nlmsg_seq = (uint32_t)(base + i) + 1; /* the reply says which record it is */
      r->req.sdiag_family = c->family;
      r->req.sdiag_protocol = IPPROTO_TCP;
      r->req.idiag_ext = REQUEST_EXT;
      r->req.idiag_states = ~0u;
      r->req.id.idiag_sport = htons(c->local_port);
      r->req.id.idiag_dport = htons(c->remote_port);
      memcpy(r->req.id.idiag_src, c->local_addr, 16);
      memcpy(r->req.id.idiag_dst, c->remote_addr, 16);
      r->req.id.idiag_if = c->ifindex;
      /* The cookie makes the kernel refuse a different socket that reuses the 4-tuple. */
      r->req.id.idiag_cookie[0] = (uint32_t)c->cookie;
      r->req.id.idiag_cookie[1] = (uint32_t)(c->cookie >> 32);
    }
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    ssize_t sent;
    do {
      sent = sendto(fd, reqs, (size_t)m * sizeof *reqs, 0, (struct sockaddr*)&kernel,
                    sizeof kernel);
    } while (sent < 0 && errno == EINTR);
    if (sent < 0) {
      rc = -errno;
      break;
    }

    /* Exactly one reply per request: the socket's record, or an error (gone). */
    int pending = m;
    while (rc == 0 && pending > 0) {
      struct iovec iov = {.iov_base = buf, .iov_len = RECV_BUF_BYTES};
      struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
      ssize_t got = recvmsg(fd, &mh, 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        rc = errno == EAGAIN ? -ETIMEDOUT : -errno;
        break;
      }
      int len = (int)got;
      for (struct nlmsghdr* h = (struct nlmsghdr*)buf; NLMSG_OK(h, len);
           h = NLMSG_NEXT(h, len)) {
        int idx = (int)h->nlmsg_seq - 1;
        if (idx < base || idx >= base + m) continue;
        pending--;
        if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) continue; /* error: socket gone */
        const struct inet_diag_msg* dm = NLMSG_DATA(h);
        if (h->nlmsg_len < NLMSG_LENGTH(sizeof *dm)) continue;
        /* After close() a socket can linger (FIN_WAIT, ...) with no owner: inode 0. */
        if (dm->idiag_inode != conns[idx].inode) continue;
        int attr_len = (int)h->nlmsg_len - (int)NLMSG_LENGTH(NLMSG_ALIGN(sizeof *dm));
        fill_conn(&conns[idx], dm, attr_len, now);
        alive[idx] = 1;
      }
    }
  }

  int kept = 0;
  if (rc == 0) {
    for (int i = 0; i < n; i++) {
      if (!alive[i]) continue;
      if (kept != i) conns[kept] = conns[i];
      kept++;
    }
  }
  if (fd >= 0) close(fd);
  free(alive);
  free(buf);
  free(reqs);
  return rc < 0 ? rc : kept;
}
