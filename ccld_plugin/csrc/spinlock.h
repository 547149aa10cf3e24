/* A test-and-test-and-set spin lock for the plugin's short critical sections (a few
 * field updates: no syscalls, no allocation, safe on NCCL's proxy thread). Internal. */
#ifndef CCLD_SPINLOCK_H
#define CCLD_SPINLOCK_H

#include <stdint.h>

static inline void ccld_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static inline void ccld_spin_lock(uint32_t* l) {
  while (__atomic_exchange_n(l, 1u, __ATOMIC_ACQUIRE))
    while (__atomic_load_n(l, __ATOMIC_RELAXED)) ccld_cpu_relax();
}

static inline void ccld_spin_unlock(uint32_t* l) { __atomic_store_n(l, 0u, __ATOMIC_RELEASE); }

#endif
