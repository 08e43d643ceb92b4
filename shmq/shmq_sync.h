/*
 * shmq_sync.h — waiting and waking on 32-bit words in shared memory.
 *
 * The one futex primitive of shmq: the ring (shmq_ring.h) sleeps on its
 * data_seq/space_seq words with it, and programs built on shmq (the loader)
 * sleep on words of their own shared arrays with it.  No Python; a C
 * program or Cython module can include it (sync.pxd declares it for
 * Cython).
 *
 * Contract of a wait: shmq_word_wait(word, expect, timeout_ns) sleeps only
 * while *word == expect, for at most timeout_ns, and returns early on a
 * wake-up or a signal (EINTR).  It can also return spuriously, so callers
 * re-check their condition in a loop, and re-check signals, liveness of
 * their peers and deadlines between slices: no wait is unbounded.
 *
 * The pattern that makes it lossless (an "eventcount", as in shmq_ring.h's
 * "Waiting" section):
 *
 *   waiter                                   waker
 *   seq = load_acquire(word)                 change the state (any atomic
 *   announce (e.g. fetch_add(waiters, 1))      store, seq_cst)
 *   fence / seq_cst RMW                      fence (seq_cst)
 *   if condition holds: done                 if load(waiters):
 *   shmq_word_wait(word, seq, slice)             fetch_add(word, 1)
 *   withdraw (fetch_add(waiters, -1))            shmq_word_wake(word, n)
 *
 * Either the waiter sees the new state, or the waker sees the waiter and
 * bumps the word, which makes FUTEX_WAIT return at once if the waiter has
 * not gone to sleep yet.
 *
 * Not FUTEX_PRIVATE: the words are shared between processes.
 */
#ifndef SHMQ_SYNC_H
#define SHMQ_SYNC_H

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHMQ_WAKE_ALL INT_MAX

/* Sleep while *word == expect, at most timeout_ns.  Returns 0 when the
 * sleep ended early (woken, value already different, or a signal) and 1
 * when the timeout passed.  Either way the caller re-checks. */
static inline int shmq_word_wait(uint32_t *word, uint32_t expect, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ULL), (long)(timeout_ns % 1000000000ULL)};
    long rc = syscall(SYS_futex, word, FUTEX_WAIT, expect, &ts, NULL, 0);
    return rc != 0 && errno == ETIMEDOUT;
}

/* Wake up to n sleepers of word (SHMQ_WAKE_ALL: all).  Returns how many
 * were woken.  Callers change the word (or the state a waiter checks)
 * before they wake. */
static inline int shmq_word_wake(uint32_t *word, int n) {
    long rc = syscall(SYS_futex, word, FUTEX_WAKE, n, NULL, NULL, 0);
    return rc < 0 ? 0 : (int)rc;
}

#endif /* SHMQ_SYNC_H */
