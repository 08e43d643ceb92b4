/* Tests of shmq_ring.h from plain C, without Python: proof that the header
 * stands alone, a race test of the lock-free algorithm that can run under
 * ThreadSanitizer, and the MPSC claim protocol with producers that die
 * (R24: no permanent wait).
 *
 *   ring_test offsets         print sizes/offsets as JSON (compared with the
 *                             Cython build by tests/shmq_layer/test_layout.py)
 *   ring_test spsc N          N records through a 4 KiB ring, one thread each side
 *   ring_test mpsc P N        P producer threads x N records, one consumer
 *   ring_test stale-claim     the interleavings of NOTE [claim announcement],
 *                             replayed step by step with real processes:
 *                             announce, a rival's CAS, failed CAS, full ring,
 *                             dead claimer (one line per case)
 *   ring_test mpsc-deaths P N ROUNDS SEED
 *                             P producer processes x N records per round; each
 *                             may SIGKILL itself at any step of a claim or
 *                             write; the consumer must get every record of
 *                             the others, in order, and never wait forever
 *
 * Each record carries (producer, seq, size) and a byte pattern derived from
 * them; the consumer checks all of it and per-producer order.  Every test
 * prints "<n> passed, <m> failed" last. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <stdint.h>

/* The test points inside shmq_claim (SHMQ_TEST_POINT in shmq_ring.h) call
 * this; defined below. */
static void ring_test_point(int point);
#define SHMQ_TEST_POINT(point) ring_test_point(point)
#include "shmq_ring.h"

/* --- test points (SHMQ_TEST_POINT in shmq_ring.h) ------------------------ */

#define POINT_CLAIMED 10        /* shmq_claim returned OK, nothing written */
#define POINT_BEFORE_PUBLISH 11 /* record written, not published            */

static unsigned tp_pause_mask, tp_die_mask; /* bit per point, each used once  */
static int tp_ready_fd = -1, tp_go_fd = -1;  /* pause: tell the parent, wait   */
static uint32_t tp_die_odds;                 /* random death: 1 in tp_die_odds */
static uint64_t tp_rng;
/* Shared by every process of a round: deaths inside an unconfirmed window
 * (announced .. confirmed/withdrawn) are limited to one per round, because
 * two of them at one position with different sizes are the one case the
 * protocol reports as lost (SHMQ_AMBIGUOUS; the stale-claim test covers
 * it on purpose). */
static uint32_t *tp_window_token;
static uint32_t *attached_producers; /* same shared page: a start barrier */

static uint64_t rng_next(void) {
    tp_rng ^= tp_rng << 13;
    tp_rng ^= tp_rng >> 7;
    tp_rng ^= tp_rng << 17;
    return tp_rng;
}

static void die_now(void) { raise(SIGKILL); }

static void ring_test_point(int point) {
    unsigned bit = 1u << point;
    if (tp_die_mask & bit) die_now();
    if (tp_pause_mask & bit) {
        tp_pause_mask &= ~bit;
        char c = (char)point;
        if (write(tp_ready_fd, &c, 1) != 1 || read(tp_go_fd, &c, 1) != 1) _exit(5);
    }
    if (tp_die_odds && rng_next() % tp_die_odds == 0) {
        int in_window = point == SHMQ_POINT_ANNOUNCED || point == SHMQ_POINT_LOST_CAS ||
                        point == SHMQ_POINT_WON_CAS;
        uint32_t free_token = 0;
        if (!in_window || __atomic_compare_exchange_n(tp_window_token, &free_token, 1, 0,
                                                      __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            die_now();
    }
}


#define CAPACITY 4096u

static uint8_t *map_ring(uint64_t capacity, int mpsc) {
    uint64_t so, ao, dof;
    shmq_layout(capacity, mpsc, SHMQ_MAX_ATTACH, &so, &ao, &dof);
    int fd = memfd_create("shmq-ring-test", 0);
    if (fd < 0 || ftruncate(fd, (off_t)(dof + capacity)) != 0) { perror("memfd"); exit(2); }
    uint8_t *base = mmap(NULL, dof + 2 * capacity, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mmap(base, dof + capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED ||
        mmap(base + dof + capacity, capacity, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t)dof) == MAP_FAILED) {
        perror("mmap"); exit(2);
    }
    close(fd);
    shmq_init(base, capacity, mpsc, (uint32_t)getpid(), shmq_proc_starttime((uint32_t)getpid()),
              shmq_self_pidns());
    return base;
}

static void unmap_ring(uint8_t *base, uint64_t capacity, int mpsc) {
    uint64_t so, ao, dof;
    shmq_layout(capacity, mpsc, SHMQ_MAX_ATTACH, &so, &ao, &dof);
    munmap(base, dof + 2 * capacity);
}

static uint64_t record_size(uint32_t p, uint64_t s) { return (s * 2654435761u + p * 977u) % 700; }

static uint8_t pattern(uint32_t p, uint64_t s, uint64_t i) { return (uint8_t)(p * 31 + s * 7 + i); }

static uint64_t record_need(uint64_t n) {
    return shmq_align_up(sizeof(shmq_record) + 16 + n, SHMQ_RECORD_ALIGN);
}

/* Write record (p, s) of payload n into a claimed [pos, pos+need). */
static void fill_record(shmq_ring *r, uint64_t pos, uint64_t need, uint32_t p, uint64_t s, uint64_t n) {
    uint8_t *rec = shmq_at(r, pos);
    ((shmq_record *)rec)->record_bytes = need;
    ((shmq_record *)rec)->kind = SHMQ_KIND_ARRAY;
    uint64_t *ids = (uint64_t *)(rec + sizeof(shmq_record));
    ids[0] = ((uint64_t)p << 32) | n;
    ids[1] = s;
    for (uint64_t i = 0; i < n; i++) rec[sizeof(shmq_record) + 16 + i] = pattern(p, s, i);
}

/* Check the record at pos; returns 0 and sets *p, *s if it is intact. */
static int check_record(shmq_ring *r, uint64_t pos, uint32_t producers, uint32_t *p, uint64_t *s) {
    uint8_t *rec = shmq_at(r, pos);
    uint64_t *ids = (uint64_t *)(rec + sizeof(shmq_record));
    *p = (uint32_t)(ids[0] >> 32);
    *s = ids[1];
    uint64_t n = ids[0] & 0xffffffffu;
    if (*p >= producers || n != record_size(*p, *s)) return 1;
    for (uint64_t i = 0; i < n; i++)
        if (rec[sizeof(shmq_record) + 16 + i] != pattern(*p, *s, i)) return 1;
    return 0;
}

/* --- threads: spsc / mpsc races (ThreadSanitizer-friendly) --------------- */

typedef struct { uint8_t *base; int mpsc; uint32_t producer; uint64_t count; } producer_arg;

static void *producer(void *varg) {
    producer_arg *a = varg;
    shmq_ring r;
    shmq_bind(&r, a->base, CAPACITY, a->mpsc);
    r.slot = shmq_slot_acquire(&r, (uint32_t)getpid(), 0, SHMQ_SLOT_OPEN | SHMQ_SLOT_PRODUCED);
    for (uint64_t s = 0; s < a->count; s++) {
        uint64_t n = record_size(a->producer, s), need = record_need(n), pos;
        while (shmq_claim(&r, need, &pos) != SHMQ_OK) shmq_wait_writable(&r, need, 1000000);
        fill_record(&r, pos, need, a->producer, s, n);
        shmq_publish(&r, pos, need);
    }
    return NULL;
}

static int consume(uint8_t *base, int mpsc, uint32_t producers, uint64_t per_producer) {
    shmq_ring r;
    shmq_bind(&r, base, CAPACITY, mpsc);
    r.slot = shmq_slot_acquire(&r, (uint32_t)getpid(), 0, SHMQ_SLOT_OPEN);
    shmq_take_role(&r, &r.hdr->consumer_slot, r.slot, SHMQ_SLOT_CONSUMER, 0);
    uint64_t next[64] = {0}, total = (uint64_t)producers * per_producer, got = 0;
    int failures = 0;
    while (got < total) {
        uint64_t pos, bytes, s;
        uint32_t p;
        int rc = shmq_peek(&r, &pos, &bytes);
        if (rc == SHMQ_CORRUPT) { fprintf(stderr, "corrupt record at %lu\n", (unsigned long)pos); return 1; }
        if (rc != SHMQ_OK) { shmq_wait_readable(&r, 1000000); continue; }
        if (check_record(&r, pos, producers, &p, &s) || s != next[p]) {
            fprintf(stderr, "record (p=%u s=%lu), expected s=%lu\n", p, (unsigned long)s,
                    (unsigned long)(p < producers ? next[p] : 0));
            failures++;
        } else {
            next[p]++;
        }
        shmq_release(&r, pos, bytes);
        got++;
    }
    return failures;
}

static int run(int mpsc, uint32_t producers, uint64_t count) {
    uint8_t *base = map_ring(CAPACITY, mpsc);
    pthread_t threads[64];
    producer_arg args[64];
    for (uint32_t p = 0; p < producers; p++) {
        args[p] = (producer_arg){base, mpsc, p, count};
        pthread_create(&threads[p], NULL, producer, &args[p]);
    }
    int failures = consume(base, mpsc, producers, count);
    for (uint32_t p = 0; p < producers; p++) pthread_join(threads[p], NULL);
    printf("%s: %u producer(s) x %lu records\n", mpsc ? "mpsc" : "spsc", producers, (unsigned long)count);
    printf("%d passed, %d failed\n", failures ? 0 : 1, failures ? 1 : 0);
    return failures != 0;
}

/* --- processes: producers that die ---------------------------------------- */

/* A producer process's handle: its own slot, its own pid and start time, so
 * that its death is visible to the consumer exactly as in production. */
static void attach_producer(shmq_ring *r, uint8_t *base) {
    uint32_t pid = (uint32_t)getpid();
    shmq_bind(r, base, CAPACITY, 1);
    r->slot = shmq_slot_acquire(r, pid, shmq_proc_starttime(pid), SHMQ_SLOT_OPEN | SHMQ_SLOT_PRODUCED);
    if (r->slot < 0) _exit(6);
    if (attached_producers) __atomic_fetch_add(attached_producers, 1, __ATOMIC_SEQ_CST);
}

/* Claim need bytes, waiting in slices, at most 20 s (then exit 4). */
static uint64_t claim_or_exit(shmq_ring *r, uint64_t need) {
    uint64_t pos, deadline = shmq_now_ns() + 20000000000ULL;
    int rc;
    while ((rc = shmq_claim(r, need, &pos)) != SHMQ_OK) {
        if (rc == SHMQ_CORRUPT) _exit(3);
        if (shmq_now_ns() > deadline) _exit(4);
        shmq_wait_writable(r, need, 10000000);
    }
    return pos;
}

static void produce_and_exit(uint8_t *base, uint32_t p, uint64_t count) {
    shmq_ring r;
    attach_producer(&r, base);
    for (uint64_t s = 0; s < count; s++) {
        uint64_t n = record_size(p, s), need = record_need(n);
        uint64_t pos = claim_or_exit(&r, need);
        ring_test_point(POINT_CLAIMED);
        fill_record(&r, pos, need, p, s, n);
        ring_test_point(POINT_BEFORE_PUBLISH);
        shmq_publish(&r, pos, need);
    }
    shmq_slot_close(&r, r.slot);
    _exit(0);
}

typedef struct {
    uint64_t next[64];     /* next expected seq per producer            */
    uint64_t records, abandoned, pending_polls;
    int status;            /* last terminal status                      */
    const char *problem;   /* set when a check failed                   */
} consumer_result;

/* Consume until the ring is empty and no producer is left, or until
 * stop_after records/skips, or the deadline: that is a permanent wait.  The
 * loop is the one _core.pyx runs: peek; published -> check; unpublished
 * after a wait slice -> shmq_resolve_pending. */
static void consume_until_done(shmq_ring *r, uint32_t producers, uint64_t stop_after,
                               double seconds, consumer_result *out) {
    uint64_t deadline = shmq_now_ns() + (uint64_t)(seconds * 1e9);
    int waited = 0;
    while (out->records + out->abandoned < stop_after) {
        if (shmq_now_ns() > deadline) { out->problem = "permanent wait (deadline passed)"; return; }
        uint64_t pos, bytes, s, skip = 0;
        uint32_t p, dead = 0;
        int rc = shmq_peek(r, &pos, &bytes);
        if (rc == SHMQ_OK) {
            waited = 0;
            if (check_record(r, pos, producers, &p, &s) || s != out->next[p]) {
                out->problem = "a record arrived torn, duplicated or out of order";
                return;
            }
            out->next[p]++;
            out->records++;
            shmq_release(r, pos, bytes);
            continue;
        }
        if (rc == SHMQ_CORRUPT) { out->status = rc; out->problem = "SHMQ_CORRUPT"; return; }
        if (rc == SHMQ_PENDING && waited) {
            out->pending_polls++;
            rc = shmq_resolve_pending(r, pos, &skip, &dead);
            if (rc == SHMQ_ABANDONED) {
                shmq_release(r, pos, skip);
                out->abandoned++;
                continue;
            }
            if (rc != SHMQ_PENDING) { out->status = rc; return; }
        } else if (rc == SHMQ_EMPTY && waited) {
            int st = shmq_writers_status(r);
            if (st != SHMQ_PEERS_OPEN && shmq_peek(r, &pos, &bytes) == SHMQ_EMPTY) {
                out->status = st;
                return;
            }
        }
        waited = shmq_wait_readable(r, 10000000) == SHMQ_TIMEOUT;
        if (!waited && rc == SHMQ_PENDING) waited = 1; /* readable() said published: re-peek */
    }
}

static void attach_consumer(shmq_ring *r, uint8_t *base) {
    uint32_t pid = (uint32_t)getpid();
    shmq_bind(r, base, CAPACITY, 1);
    r->slot = shmq_slot_acquire(r, pid, shmq_proc_starttime(pid), SHMQ_SLOT_OPEN);
    shmq_take_role(r, &r->hdr->consumer_slot, r->slot, SHMQ_SLOT_CONSUMER, 0);
}

/* --- stale-claim: NOTE [claim announcement], step by step ----------------- */

/* B wins the CAS for head and dies (before or after confirming); A had
 * announced head before B's CAS, loses its CAS, finds the ring full (B's
 * claim filled it) and then withdraws, dies, or is stopped right there.
 * The consumer must skip B's record and then deliver A's, or report the
 * one ambiguous case, all without waiting forever. */
typedef struct {
    const char *name;
    unsigned b_die;          /* point where B dies (0: right after its claim) */
    unsigned a_pause2;       /* second pause of A (A alive, announcement stale) */
    unsigned a_die;          /* A dies here instead                         */
    uint64_t b_need, a_need;
    int expect_status;       /* terminal status (B died unclosed: PEERS_LOST) */
    uint64_t expect_abandoned;
    int expect_a_record;     /* A's record is delivered                     */
    int expect_waits_for_a;  /* the consumer must keep waiting while A is stopped */
} stale_case;

#define BIT(p) (1u << (p))

static int wait_byte(int fd, double seconds) {
    uint64_t deadline = shmq_now_ns() + (uint64_t)(seconds * 1e9);
    char c;
    while (shmq_now_ns() < deadline) {
        ssize_t n = read(fd, &c, 1);
        if (n == 1) return c;
        if (n == 0) return -1;
        usleep(1000);
    }
    return -1;
}

static int run_stale_case(const stale_case *c) {
    uint8_t *base = map_ring(CAPACITY, 1);
    shmq_ring cons;
    attach_consumer(&cons, base);
    int ready[2], go[2];
    if (pipe2(ready, O_NONBLOCK) || pipe(go)) { perror("pipe"); exit(2); }
    pid_t a = fork();
    if (a == 0) { /* A: announce head, stop, then lose the CAS to B */
        tp_ready_fd = ready[1];
        tp_go_fd = go[0];
        tp_pause_mask = BIT(SHMQ_POINT_ANNOUNCED) | c->a_pause2;
        tp_die_mask = c->a_die;
        shmq_ring r;
        attach_producer(&r, base);
        uint64_t pos = claim_or_exit(&r, c->a_need);
        fill_record(&r, pos, c->a_need, 1, 0, record_size(1, 0));
        shmq_publish(&r, pos, c->a_need);
        shmq_slot_close(&r, r.slot);
        _exit(0);
    }
    const char *problem = NULL;
    if (wait_byte(ready[0], 10) != SHMQ_POINT_ANNOUNCED) problem = "A did not announce";
    pid_t b = problem ? -1 : fork();
    if (b == 0) { /* B: claim head (A's announced position) and die */
        tp_die_mask = c->b_die;
        shmq_ring r;
        attach_producer(&r, base);
        claim_or_exit(&r, c->b_need);
        die_now();
    }
    if (b > 0) waitpid(b, NULL, 0);
    consumer_result res = {0};
    if (!problem) {
        char go_c = 1;
        if (write(go[1], &go_c, 1) != 1) problem = "cannot resume A";
    }
    if (!problem && c->a_pause2) {
        /* A is stopped with its stale announcement of head, alive. */
        if (wait_byte(ready[0], 10) < 0) problem = "A did not reach its second stop";
        if (!problem && c->expect_waits_for_a) {
            consume_until_done(&cons, 2, 1, 0.5, &res);  /* must NOT resolve yet */
            if (res.abandoned || res.records || res.pending_polls == 0) problem = "did not wait for a live announcer";
            res.problem = NULL;
        } else if (!problem) {
            consume_until_done(&cons, 2, 1, 5, &res);    /* rule 1: B is OWNED */
            if (res.abandoned != 1) problem = res.problem ? res.problem : "B's confirmed claim was not skipped while A's stale one was live";
        }
        char go_c = 1;
        if (!problem && write(go[1], &go_c, 1) != 1) problem = "cannot resume A";
    }
    if (!problem) consume_until_done(&cons, 2, 1000, 10, &res);
    if (!problem && res.problem && res.status != c->expect_status) problem = res.problem;
    if (!problem && res.status != c->expect_status) problem = "unexpected terminal status";
    if (!problem && res.abandoned != c->expect_abandoned) problem = "wrong number of records skipped";
    if (!problem && (res.next[1] == 1) != c->expect_a_record) problem = "A's record delivered wrongly";
    kill(a, SIGKILL);
    int st;
    waitpid(a, &st, 0);
    close(ready[0]); close(ready[1]); close(go[0]); close(go[1]);
    unmap_ring(base, CAPACITY, 1);
    printf("%-58s %s (status %d, skipped %lu, A's record %s)\n", c->name, problem ? problem : "ok",
           res.status, (unsigned long)res.abandoned, res.next[1] ? "delivered" : "not delivered");
    return problem != NULL;
}

static int stale_claim(void) {
    const uint64_t B = 3072, A = 2048, A_SAME = 3072; /* B + A > capacity: A finds the ring full */
    const stale_case cases[] = {
        {"B dies after confirming, A withdraws", 0, 0, 0, B, A, SHMQ_PEERS_LOST, 1, 1, 0},
        {"B dies before confirming, A withdraws", BIT(SHMQ_POINT_WON_CAS), 0, 0, B, A, SHMQ_PEERS_LOST, 1, 1, 0},
        {"B dies after confirming, A stopped with stale claim", 0, BIT(SHMQ_POINT_LOST_CAS), 0, B, A,
         SHMQ_PEERS_LOST, 1, 1, 0},
        {"B dies before confirming, A stopped with stale claim", BIT(SHMQ_POINT_WON_CAS),
         BIT(SHMQ_POINT_LOST_CAS), 0, B, A, SHMQ_PEERS_LOST, 1, 1, 1},
        {"B dies after confirming, A dies with stale claim", 0, 0, BIT(SHMQ_POINT_LOST_CAS), B, A,
         SHMQ_PEERS_LOST, 1, 0, 0},
        {"both die unconfirmed, same size", BIT(SHMQ_POINT_WON_CAS), 0, BIT(SHMQ_POINT_LOST_CAS), B,
         A_SAME, SHMQ_PEERS_LOST, 1, 0, 0},
        {"both die unconfirmed, sizes differ: reported, not waited on", BIT(SHMQ_POINT_WON_CAS), 0,
         BIT(SHMQ_POINT_LOST_CAS), B, A, SHMQ_AMBIGUOUS, 0, 0, 0},
    };
    int n = sizeof cases / sizeof cases[0], failed = 0;
    for (int i = 0; i < n; i++) failed += run_stale_case(&cases[i]);
    printf("%d passed, %d failed\n", n - failed, failed);
    return failed != 0;
}

/* --- mpsc-deaths: random deaths at every step ----------------------------- */

static int deaths_round(uint32_t producers, uint64_t count, uint64_t seed, uint64_t *killed_total,
                        uint64_t *abandoned_total) {
    uint8_t *base = map_ring(CAPACITY, 1);
    shmq_ring cons;
    attach_consumer(&cons, base);
    *tp_window_token = 0;
    *attached_producers = 0;
    pid_t pids[64];
    for (uint32_t p = 0; p < producers; p++) {
        pids[p] = fork();
        if (pids[p] == 0) {
            tp_rng = seed * 1000003u + p + 1;
            tp_die_odds = (uint32_t)(count * 6); /* about half of the producers die */
            produce_and_exit(base, p, count);
        }
    }
    /* Every producer holds its slot before the consumer may conclude that
     * nobody is left (production reserves the slots before fork). */
    uint64_t start_by = shmq_now_ns() + 10000000000ULL;
    while (__atomic_load_n(attached_producers, __ATOMIC_SEQ_CST) < producers && shmq_now_ns() < start_by)
        usleep(1000);
    consumer_result res = {0};
    consume_until_done(&cons, producers, UINT64_MAX, 60, &res);
    const char *problem = res.problem;
    uint64_t killed = 0;
    for (uint32_t p = 0; p < producers; p++) {
        int st;
        waitpid(pids[p], &st, 0);
        if (WIFSIGNALED(st)) killed++;
        else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            problem = WEXITSTATUS(st) == 3 ? "a producer's claim said SHMQ_CORRUPT (exit 3)"
                    : WEXITSTATUS(st) == 4 ? "a producer found no room for 20 s (exit 4)"
                                           : "a producer failed (exit status)";
        else if (res.next[p] != count) problem = "a live producer's records went missing";
    }
    if (!problem && res.status != SHMQ_PEERS_LOST && res.status != SHMQ_PEERS_CLOSED)
        problem = "unexpected terminal status";
    if (!problem && res.abandoned > killed) problem = "more records skipped than producers died";
    *killed_total += killed;
    *abandoned_total += res.abandoned;
    unmap_ring(base, CAPACITY, 1);
    if (problem)
        fprintf(stderr, "seed %lu: %s (status %d, %lu records, %lu skipped, %lu killed)\n",
                (unsigned long)seed, problem, res.status, (unsigned long)res.records,
                (unsigned long)res.abandoned, (unsigned long)killed);
    return problem != NULL;
}

static int mpsc_deaths(uint32_t producers, uint64_t count, uint32_t rounds, uint64_t seed) {
    tp_window_token = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    attached_producers = tp_window_token + 16;
    uint64_t killed = 0, abandoned = 0;
    int failed = 0;
    for (uint32_t i = 0; i < rounds; i++) failed += deaths_round(producers, count, seed + i, &killed, &abandoned);
    printf("mpsc-deaths: %u rounds x %u producers x %lu records, seed %lu: %lu producers killed, "
           "%lu records skipped\n", rounds, producers, (unsigned long)count, (unsigned long)seed,
           (unsigned long)killed, (unsigned long)abandoned);
    printf("%u passed, %d failed\n", rounds - failed, failed);
    return failed != 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && !strcmp(argv[1], "offsets")) {
        printf("{\"header_bytes\": %zu, \"slot_bytes\": %zu, \"record_header_bytes\": %zu, "
               "\"array_meta_bytes\": %zu, \"tail_pos\": %zu, \"head_pos\": %zu, \"data_seq\": %zu, "
               "\"consumer_slot\": %zu, \"producer_slot\": %zu, \"creator_pid\": %zu, "
               "\"creator_starttime\": %zu, \"creator_pidns\": %zu, \"data_offset\": %zu, \"slot.claim_pos\": %zu, "
               "\"slot.claim_bytes\": %zu, \"record.kind\": %zu, \"array.data_offset\": %zu, "
               "\"claim_owned_bit\": %llu, \"magic_value\": %llu, \"version_value\": %u}\n",
               sizeof(shmq_header), sizeof(shmq_slot), sizeof(shmq_record), sizeof(shmq_array_meta),
               offsetof(shmq_header, tail_pos), offsetof(shmq_header, head_pos),
               offsetof(shmq_header, data_seq), offsetof(shmq_header, consumer_slot),
               offsetof(shmq_header, producer_slot), offsetof(shmq_header, creator_pid),
               offsetof(shmq_header, creator_starttime), offsetof(shmq_header, creator_pidns),
               offsetof(shmq_header, data_offset),
               offsetof(shmq_slot, claim_pos), offsetof(shmq_slot, claim_bytes),
               offsetof(shmq_record, kind), offsetof(shmq_array_meta, data_offset),
               (unsigned long long)SHMQ_CLAIM_OWNED, (unsigned long long)SHMQ_MAGIC, SHMQ_VERSION);
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "spsc")) return run(0, 1, strtoull(argv[2], NULL, 10));
    if (argc == 4 && !strcmp(argv[1], "mpsc")) {
        uint32_t p = (uint32_t)strtoul(argv[2], NULL, 10);
        if (p < 1 || p > 64) return 2;
        return run(1, p, strtoull(argv[3], NULL, 10));
    }
    if (argc == 2 && !strcmp(argv[1], "stale-claim")) return stale_claim();
    if (argc == 6 && !strcmp(argv[1], "mpsc-deaths")) {
        uint32_t p = (uint32_t)strtoul(argv[2], NULL, 10);
        if (p < 1 || p > 64) return 2;
        return mpsc_deaths(p, strtoull(argv[3], NULL, 10), (uint32_t)strtoul(argv[4], NULL, 10),
                           strtoull(argv[5], NULL, 10));
    }
    fprintf(stderr, "usage: ring_test offsets | spsc N | mpsc P N | stale-claim | "
                    "mpsc-deaths P N ROUNDS SEED\n");
    return 2;
}
