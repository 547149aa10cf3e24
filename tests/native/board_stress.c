/* Stress the board's seqlock: writer threads hammer the op ring while a reader copies it.
 * Every record carries fields derived from its seq, so a torn copy cannot pass the check.
 * The records are P2P ones (a seq of their own, a peer in the world), as the tracer writes
 * them, so that the Python reader's record checks accept them too.
 *   board_stress PATH THREADS OPS_PER_THREAD   -> prints "torn=N checked=M"
 *   board_stress PATH THREADS 0                -> write forever (for a reader in another
 *                                                 process, or to be killed mid-write)
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "board.h"

static ccld_board* board;
static long ops_per_thread;
static volatile int writers_done;

static void* writer(void* arg) {
  uint64_t base = (uint64_t)(uintptr_t)arg * 1000000000ULL;
  for (long i = 1; ops_per_thread == 0 || i <= ops_per_thread; i++) {
    uint64_t seq = base + (uint64_t)i;
    uint64_t idx =
        ccld_op_enter(board, 0, 1, CCLD_FLAG_P2P, seq * 3 + 1, (int32_t)(seq % 1000), seq);
    ccld_op_exit(board, idx, 2);
  }
  return NULL;
}

static int consistent(const ccld_op_record* r) {
  if (r->lock & 1u) return 1; /* dropped by readers */
  if (r->state == 0) return 1;
  return r->bytes == r->seq * 3 + 1 && r->peer == (int32_t)(r->seq % 1000) && r->op == 1;
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  int threads = atoi(argv[2]);
  ops_per_thread = atol(argv[3]);
  board = ccld_board_create(argv[1], 0, 1000, "stress", "host", 16, 4, 0, 16);
  if (!board) return 3;
  int32_t ranks[1] = {0};
  ccld_group_register(board, 42, 0, ranks, 1, 0);
  pthread_t t[64];
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, writer, (void*)(uintptr_t)(i + 1));
  if (ops_per_thread == 0) {
    printf("writing\n");
    fflush(stdout);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    return 0;
  }
  ccld_header* h = ccld_board_header(board);
  const void* ring = (const char*)h + h->ring_off;
  size_t bytes = (size_t)h->ring_size * sizeof(ccld_op_record);
  ccld_op_record* copy = malloc(bytes);
  long torn = 0, checked = 0;
  int rounds = 0;
  while (!writers_done || rounds < 1) {
    ccld_copy_records(ring, copy, h->ring_size, sizeof(ccld_op_record));
    for (uint32_t i = 0; i < h->ring_size; i++) {
      if (!(copy[i].lock & 1u) && copy[i].state) checked++;
      if (!consistent(&copy[i])) torn++;
    }
    rounds++;
    if (!writers_done && __atomic_load_n(&h->ops_written, __ATOMIC_RELAXED) >=
                             (uint64_t)threads * (uint64_t)ops_per_thread)
      writers_done = 1;
  }
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  printf("torn=%ld checked=%ld rounds=%d\n", torn, checked, rounds);
  free(copy);
  ccld_board_close(board, 1);
  return torn != 0;
}
