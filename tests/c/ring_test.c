/* Tests of shmq_ring.h from plain C, without Python: proof that the header
 * stands alone, and a race test of the lock-free algorithm that can run
 * under ThreadSanitizer.
 *
 *   ring_test offsets      print sizes/offsets as JSON (compared with the
 *                          Cython build by tests/test_layout.py)
 *   ring_test spsc N       N records through a 4 KiB ring, one thread each side
 *   ring_test mpsc P N     P producer threads x N records, one consumer
 *
 * Each record carries (producer, seq, size) and a byte pattern derived from
 * them; the consumer checks all of it and per-producer order. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sys/mman.h>

#include "shmq_ring.h"

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
    shmq_init(base, capacity, mpsc, (uint32_t)getpid(), shmq_proc_starttime((uint32_t)getpid()));
    return base;
}

typedef struct { uint8_t *base; int mpsc; uint32_t producer; uint64_t count; } producer_arg;

static uint64_t record_size(uint32_t p, uint64_t s) { return (s * 2654435761u + p * 977u) % 700; }

static uint8_t pattern(uint32_t p, uint64_t s, uint64_t i) { return (uint8_t)(p * 31 + s * 7 + i); }

static void *producer(void *varg) {
    producer_arg *a = varg;
    shmq_ring r;
    shmq_bind(&r, a->base, 4096, a->mpsc);
    r.slot = shmq_slot_acquire(&r, (uint32_t)getpid(), 0, SHMQ_SLOT_OPEN | SHMQ_SLOT_PRODUCED);
    for (uint64_t s = 0; s < a->count; s++) {
        uint64_t n = record_size(a->producer, s);
        uint64_t need = shmq_align_up(sizeof(shmq_record) + 16 + n, SHMQ_RECORD_ALIGN);
        uint64_t pos;
        while (shmq_claim(&r, need, &pos) != SHMQ_OK) shmq_wait_writable(&r, need, 1000000);
        uint8_t *rec = shmq_at(&r, pos);
        ((shmq_record *)rec)->record_bytes = need;
        ((shmq_record *)rec)->kind = SHMQ_KIND_ARRAY;
        uint64_t *ids = (uint64_t *)(rec + sizeof(shmq_record));
        ids[0] = ((uint64_t)a->producer << 32) | n;
        ids[1] = s;
        for (uint64_t i = 0; i < n; i++) rec[sizeof(shmq_record) + 16 + i] = pattern(a->producer, s, i);
        shmq_publish(&r, pos, need);
    }
    return NULL;
}

static int consume(uint8_t *base, int mpsc, uint32_t producers, uint64_t per_producer) {
    shmq_ring r;
    shmq_bind(&r, base, 4096, mpsc);
    r.slot = shmq_slot_acquire(&r, (uint32_t)getpid(), 0, SHMQ_SLOT_OPEN);
    shmq_take_role(&r, &r.hdr->consumer_slot, r.slot, SHMQ_SLOT_CONSUMER, 0);
    uint64_t next[64] = {0}, total = (uint64_t)producers * per_producer, got = 0;
    int failures = 0;
    while (got < total) {
        uint64_t pos, bytes;
        int rc = shmq_peek(&r, &pos, &bytes);
        if (rc == SHMQ_CORRUPT) { fprintf(stderr, "corrupt record at %lu\n", (unsigned long)pos); return 1; }
        if (rc != SHMQ_OK) { shmq_wait_readable(&r, 1000000); continue; }
        uint8_t *rec = shmq_at(&r, pos);
        uint64_t *ids = (uint64_t *)(rec + sizeof(shmq_record));
        uint32_t p = (uint32_t)(ids[0] >> 32);
        uint64_t n = ids[0] & 0xffffffffu, s = ids[1];
        if (p >= producers || s != next[p] || n != record_size(p, s)) {
            fprintf(stderr, "record (p=%u s=%lu n=%lu), expected s=%lu\n", p, (unsigned long)s,
                    (unsigned long)n, (unsigned long)(p < producers ? next[p] : 0));
            failures++;
        } else {
            for (uint64_t i = 0; i < n; i++)
                if (rec[sizeof(shmq_record) + 16 + i] != pattern(p, s, i)) { failures++; break; }
            next[p]++;
        }
        shmq_release(&r, pos, bytes);
        got++;
    }
    return failures;
}

static int run(int mpsc, uint32_t producers, uint64_t count) {
    uint8_t *base = map_ring(4096, mpsc);
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

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "offsets")) {
        printf("{\"header_bytes\": %zu, \"slot_bytes\": %zu, \"record_header_bytes\": %zu, "
               "\"array_meta_bytes\": %zu, \"tail_pos\": %zu, \"head_pos\": %zu, \"data_seq\": %zu, "
               "\"consumer_slot\": %zu, \"creator_pid\": %zu, \"creator_starttime\": %zu, "
               "\"data_offset\": %zu, \"slot.claim_pos\": %zu, \"record.kind\": %zu, "
               "\"array.data_offset\": %zu, \"magic_value\": %llu, \"version_value\": %u}\n",
               sizeof(shmq_header), sizeof(shmq_slot), sizeof(shmq_record), sizeof(shmq_array_meta),
               offsetof(shmq_header, tail_pos), offsetof(shmq_header, head_pos),
               offsetof(shmq_header, data_seq), offsetof(shmq_header, consumer_slot),
               offsetof(shmq_header, creator_pid), offsetof(shmq_header, creator_starttime),
               offsetof(shmq_header, data_offset), offsetof(shmq_slot, claim_pos),
               offsetof(shmq_record, kind), offsetof(shmq_array_meta, data_offset),
               (unsigned long long)SHMQ_MAGIC, SHMQ_VERSION);
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "spsc")) return run(0, 1, strtoull(argv[2], NULL, 10));
    if (argc == 4 && !strcmp(argv[1], "mpsc")) {
        uint32_t p = (uint32_t)strtoul(argv[2], NULL, 10);
        if (p < 1 || p > 64) return 2;
        return run(1, p, strtoull(argv[3], NULL, 10));
    }
    fprintf(stderr, "usage: ring_test offsets | spsc N | mpsc P N\n");
    return 2;
}
