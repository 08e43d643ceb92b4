/*
 * shmq_ring.h — the shared-memory ring: memory layout and algorithm.
 *
 * This header is the single authority for the layout of a shmq segment.  It
 * has no Python dependency; a C program can include it, map a segment the way
 * shmq_map_layout() describes, and speak the protocol.  _ring.pxd mirrors the
 * declarations Cython needs and MUST MATCH this file (tests/shmq_layer/test_layout.py
 * checks the offsets from both sides).
 *
 * ---------------------------------------------------------------------------
 * Segment (one POSIX shm object, name "/shmq-<pid>-<token>")
 * ---------------------------------------------------------------------------
 *
 *   offset 0                     shmq_header            (4 cache lines + pad)
 *   slots_offset                 shmq_slot[max_attach]  (one cache line each)
 *   avail_offset                 uint32_t[capacity/64]  (MPSC only, else empty)
 *   data_offset (page aligned)   data[capacity_bytes]   (capacity = 2^k >= page)
 *
 * Segment names.  shmq creates "/shmq-[<kind>-]<pid>-<12 hex digits>".  Any
 * name handed to attach, list or clean must be "/" followed by 1 to 255
 * characters of the POSIX portable filename set [A-Za-z0-9._-], and not
 * "/." or "/..": no NUL byte (shm_open takes a C string), no other "/", no
 * byte a terminal or a shell would interpret.  The leading "/" may be left
 * out (as `ls /dev/shm` shows the name, and as multiprocessing's shared
 * memory accepts it): the name is the same.  shmq checks this before any
 * system call sees the name (segment.check_name) and raises ValueError
 * naming the rule; an entry of /dev/shm that breaks it is not a segment.
 *
 * Every process maps the data region TWICE, back to back, right after the
 * header pages:  [header|slots|avail][data][data again].  A record that runs
 * past the end of the ring therefore stays contiguous in virtual memory, so a
 * record never wraps, a numpy view of it is one plain array, and the whole
 * capacity is usable by a single message.
 *
 * Positions (head_pos, tail_pos, a record's pos) are monotonic byte counters
 * that never wrap in practice (2^64 bytes); the byte index is pos & (cap-1).
 *
 * ---------------------------------------------------------------------------
 * Records
 * ---------------------------------------------------------------------------
 * A record starts at a position that is a multiple of SHMQ_RECORD_ALIGN (64),
 * so array data inside it is 64-byte aligned and two records never share a
 * cache line.  Layout of a record (shmq_record, then kind-specific metadata,
 * then payload at 64-aligned offsets):
 *
 *   0   u64 record_bytes   total length incl. this header, multiple of 64
 *   8   u32 kind           SHMQ_KIND_ARRAY / _TREE / _SKIP
 *   12  u32 nbuffers       number of entries in the buffer table
 *   16  u64 meta_bytes     bytes of kind-specific metadata after this header
 *   24  u32 producer_pid   informational (error messages)
 *   28  u32 reserved
 *   32  metadata ...
 *
 * The consumer validates every field against the ring before it trusts it
 * (see shmq_peek and the Cython decoder); a hostile or corrupt segment gives
 * SHMQ_CORRUPT, never an out-of-bounds read.  The rules follow.
 *
 * ---------------------------------------------------------------------------
 * Trusting shared memory (NOTE [validation])
 * ---------------------------------------------------------------------------
 * Any process of the same user can write any byte of a segment at any time,
 * also while we are attached.  So nothing read from shared memory is used as
 * a size, an index or an offset before it has been checked, EVERY time it is
 * read (not only at attach), and a value is read once into a local and the
 * local is what gets checked and used (no check-then-reread).
 *
 *   geometry     capacity_bytes, flags, the region offsets and max_attach are
 *                checked once by shmq_validate at attach and then copied
 *                into the process-local shmq_ring (shmq_bind takes them from
 *                the caller, not from the header).  They are never read
 *                from the header again, so a later write cannot move the
 *                mapping or send a slot loop past the slot array: loops
 *                run to SHMQ_MAX_ATTACH.
 *   head_pos,    every read pair must satisfy: tail - head <= capacity
 *   tail_pos     (unsigned, so head > tail fails too) and both multiples of
 *                64 (shmq_positions_ok).  The consumer checks it in
 *                shmq_peek, the producer whenever it reloads head
 *                (shmq_has_space; its fast path `tail - cached_head <=
 *                capacity - need` is one unsigned compare that also fails
 *                for any tail behind head).  Who owns neither position (an
 *                MPSC producer, an attacher) must read them as a pair
 *                first (shmq_positions_read).  Bad: SHMQ_FIELD_POSITIONS.
 *   record_bytes a multiple of 64, >= the record header and <= tail - head
 *                (hence <= capacity): with the data mapped twice, every
 *                byte of the record lies inside the mapping.  Everything
 *                inside a record (meta_bytes, array/tree metadata, buffer
 *                table, pickle stream) is then checked against record_bytes
 *                by the decoder (_core.pyx); the pickle stream is scanned
 *                before it is unpickled (_check_pickle).
 *   consumer_slot, producer_slot
 *                -1 or a slot index < max_attach, checked before each use
 *                as an index (SHMQ_FIELD_CONSUMER_SLOT/_PRODUCER_SLOT).
 *   claim_pos/claim_bytes (slots)
 *                only compared with head; a claim the consumer would skip
 *                must be a multiple of 64 and <= tail - head
 *                (SHMQ_FIELD_CLAIM).
 *   avail[]      lap tags are only compared, never used as a size or
 *                index; the index into avail[] comes from our own head.
 *   owner, starttime, creator_pid/_starttime/_pidns, futex words, counters,
 *   space_wanted
 *                only compared, waited on or reported: a bad value costs a
 *                spurious wake-up, a bounded wait or a wrong liveness answer
 *                (which the caller's timeout bounds), never memory safety.
 *
 * A failed check returns SHMQ_CORRUPT and leaves the field, the value read
 * and the limit it broke in the handle (r->bad_field, bad_value, bad_limit),
 * so the one status-to-exception function can name them.
 *
 * ---------------------------------------------------------------------------
 * Publication
 * ---------------------------------------------------------------------------
 * SPSC (Lamport): the producer writes the record, then release-stores
 *   tail_pos.  The consumer acquire-loads tail_pos; everything below it is
 *   published.  Each side caches the other's position and reloads it only
 *   when its cached copy says full/empty.
 *
 * MPSC: tail_pos is the CLAIM position.  A producer first writes
 *   (claim_pos, claim_bytes) into its attachment slot, then CASes tail_pos
 *   from t to t+n.  It owns [t, t+n), writes the record, and publishes it by
 *   release-storing lap_tag(t) into avail[(t & mask) / 64].
 *   Why a separate avail array instead of a commit word inside the record:
 *   until a claimed record is published, its first bytes hold whatever the
 *   previous lap left there (often array data), which a consumer could
 *   mistake for a commit word.  avail[] is written only with lap tags, and a
 *   tag from an earlier lap can never equal the current one, so an
 *   unpublished record is recognised exactly.  (LMAX Disruptor's
 *   availableBuffer is the same idea.)
 *
 * A producer that dies between claim and publish leaves an unpublished
 * record at some position.  When the consumer's head reaches it, it finds
 * the claim through the announcements in the slots and skips it
 * (shmq_resolve_pending, see NOTE [claim announcement]).  Nothing here is a
 * lock: no process ever waits for a dead one.
 *
 * NOTE [claim announcement]
 *   producer (shmq_claim)                      slot: claim_pos, claim_bytes
 *     t = tail; room for n?  no -> FULL       (whatever it was: 0)
 *     announce                                 t, n            (n: release)
 *     CAS tail t -> t+n
 *       won:  confirm                          t, n | OWNED    (release)
 *             ... write ... publish (avail)    t, 0
 *       lost: t = new tail; room?  yes -> announce again at the new t
 *                              no  -> WITHDRAW  t, 0 -> return FULL
 *   Every path out of shmq_claim that does not own a claim withdraws, so an
 *   announcement that outlives its attempt exists only while its process is
 *   between two of these steps (a few instructions, no blocking call), or
 *   if the process died right there.
 *
 *   consumer at an unpublished head, after a wait slice:
 *     1. a slot announces head with OWNED: that claim is real (only one CAS
 *        from head can win).  Owner alive: wait, it is writing.  Owner dead:
 *        skip its n bytes.  Other announcements of head are then ignored,
 *        live or not.
 *     2. no OWNED one, but a live process announces head: wait.  It is
 *        between announce and confirm/withdraw and will take one of them
 *        as soon as it runs.
 *     3. only dead processes announce head: one of them won its CAS and
 *        died before confirming, the others died mid-attempt.  If they
 *        agree on n, skip n; if not, the next record cannot be located:
 *        SHMQ_CORRUPT (it takes two processes killed inside those windows
 *        at the same position; the consumer gets PeerLost, never a hang).
 *     4. nobody announces head: keep waiting (the record was published
 *        between our two reads, or the segment is corrupt: the caller's
 *        timeout bounds that wait).
 *   Before skipping, the avail tag is read again (after the liveness check,
 *   which is a system call): a producer that published and then died
 *   before clearing its claim must not lose its record.
 *   Why OWNED and WITHDRAW both: before this protocol, a producer whose CAS
 *   lost and that then found the ring full returned with its announcement
 *   still in place; while the ring stayed full it never announced again.
 *   If the CAS winner died before publishing, the consumer saw a live
 *   process announcing head and waited for it forever, and the ring stayed
 *   full: a deadlock (tests/shmq_layer/c/ring_test.c "stale-claim" replays it).
 *   WITHDRAW removes the stale announcement; OWNED lets rule 1 ignore one
 *   that is still there (its process is stopped inside the window).
 *
 * ---------------------------------------------------------------------------
 * Attachment slots and end of stream
 * ---------------------------------------------------------------------------
 * Every handle (the creator, each attach(), each forked child that inherits
 * a handle) owns one slot.  A slot can be reserved by one process for
 * another (SHMQ_SLOT_PENDING: before a fork, or when a queue is pickled for
 * a spawned process) and adopted by CAS when that process starts.  slot.owner packs (pid << 32) | flags and changes
 * only by CAS.  Like the write end of a pipe, every OPEN slot that is not a
 * pure consumer is a potential producer.  The consumer sees end of stream
 * when the ring is empty, no potential producer is alive and open, and at
 * least one has finished: SHMQ_PEERS_CLOSED if all finished by closing,
 * SHMQ_PEERS_LOST if any died without closing (shmq_writers_status).
 *
 * ---------------------------------------------------------------------------
 * Waiting
 * ---------------------------------------------------------------------------
 * A waiter spins briefly, then sleeps on a futex word in the header
 * (data_seq for the consumer, space_seq for producers) for at most one
 * slice.  The caller re-checks signals, closed flags and peer liveness
 * between slices, so no wait is unbounded.  Wake-ups use an eventcount:
 * the waiter announces itself (consumer_waiting, or space_wanted with the
 * bytes it needs), issues a full fence, re-checks the condition and only
 * then sleeps; the other side publishes or frees, issues a full fence and
 * bumps + wakes only when someone announced.  The two fences make "publish, then look for waiters" and
 * "announce, then look for data" impossible to interleave into a lost
 * wake-up.
 *
 * All shared fields are accessed with GCC/Clang __atomic builtins on plain
 * integers (the memory order is named at each access).
 */
#ifndef SHMQ_RING_H
#define SHMQ_RING_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shmq_sync.h"

#define SHMQ_MAGIC 0x474e4952514d4853ULL /* "SHMQRING" read as little-endian */
/* 2: header line 4 gained creator_pidns (a cleaner in another pid namespace
 *    could not tell a live creator from a dead one). */
#define SHMQ_VERSION 2u
#define SHMQ_CACHELINE 64u
#define SHMQ_RECORD_ALIGN 64u
#define SHMQ_PAGE 4096u
#define SHMQ_MIN_CAPACITY SHMQ_PAGE
#define SHMQ_MAX_CAPACITY (1ULL << 40)
#define SHMQ_MAX_ATTACH 256u
#define SHMQ_MAX_NDIM 32u
#define SHMQ_MAX_DTYPE_CHARS 32u
/* A slot reserved for a process that will adopt it (a child being forked,
 * or a process the queue was pickled for) counts as an open producer from
 * the moment of reservation, so a late starter cannot miss the stream.  If
 * nobody adopts it (the child died first, the pickle was never loaded) it
 * stops counting after this long. */
#define SHMQ_PENDING_ADOPT_NS 30000000000ULL

/* header.flags */
#define SHMQ_FLAG_MPSC 1u

/* record kinds */
#define SHMQ_KIND_ARRAY 1u /* one ndarray: shmq_array_meta                 */
#define SHMQ_KIND_TREE 2u  /* pickle-5 stream + out-of-band buffer table   */
#define SHMQ_KIND_SKIP 3u  /* cancelled reservation: consumer drops it      */

/* slot.owner low 32 bits */
#define SHMQ_SLOT_FREE 0u
#define SHMQ_SLOT_OPEN 1u
#define SHMQ_SLOT_CLOSED 2u
#define SHMQ_SLOT_GONE 3u          /* died without closing, noticed       */
#define SHMQ_SLOT_STATE_MASK 0xfu
#define SHMQ_SLOT_PRODUCED 0x10u   /* has published at least one record    */
#define SHMQ_SLOT_CONSUMER 0x20u   /* is the queue's consumer               */
#define SHMQ_SLOT_PENDING 0x40u    /* reserved by pid for another process to adopt */

/* status codes returned by the functions below */
#define SHMQ_OK 0
#define SHMQ_EMPTY 1    /* nothing published at head                       */
#define SHMQ_FULL 2     /* not enough free space                           */
#define SHMQ_PENDING 3  /* MPSC: head is claimed but not yet published     */
#define SHMQ_TIMEOUT 4  /* wait slice over                                 */
#define SHMQ_CORRUPT 5  /* a field fails validation; r->bad_field says which */
#define SHMQ_NO_SLOT 6  /* all attachment slots are taken by live handles  */
#define SHMQ_ABANDONED 7 /* MPSC: head holds a dead producer's unpublished
                            record; *skip_bytes says how long it is       */
#define SHMQ_AMBIGUOUS 8 /* MPSC: dead producers announced head with
                            different sizes; the next record is lost      */

/* peer status (distinct from the codes above so one function can map
 * every code to an exception) */
#define SHMQ_PEERS_OPEN 0    /* someone may still act: keep waiting         */
#define SHMQ_PEERS_CLOSED 10 /* every peer finished by closing              */
#define SHMQ_PEERS_LOST 11   /* a peer died without closing                 */

/* which field failed validation (for messages naming the field) */
#define SHMQ_FIELD_NONE 0
#define SHMQ_FIELD_MAGIC 1
#define SHMQ_FIELD_VERSION 2
#define SHMQ_FIELD_FLAGS 3
#define SHMQ_FIELD_CAPACITY 4
#define SHMQ_FIELD_OFFSETS 5
#define SHMQ_FIELD_FILE_SIZE 6
#define SHMQ_FIELD_POSITIONS 7
#define SHMQ_FIELD_RECORD_BYTES 8
#define SHMQ_FIELD_MAX_ATTACH 9
#define SHMQ_FIELD_ROLE_SLOT 10      /* at attach: consumer_slot or producer_slot */
#define SHMQ_FIELD_CONSUMER_SLOT 11
#define SHMQ_FIELD_PRODUCER_SLOT 12
#define SHMQ_FIELD_CLAIM 13          /* a slot's claim_pos/claim_bytes */

/* slot.claim_bytes: set once the claim's CAS won (NOTE [claim announcement]).
 * Claims are at most SHMQ_MAX_CAPACITY bytes, so the top bit is free. */
#define SHMQ_CLAIM_OWNED (1ULL << 63)

/* Test points inside shmq_claim (NOTE [claim announcement]).  A test build
 * defines SHMQ_TEST_POINT(point) before including this header to stop or
 * kill the process there (tests/shmq_layer/c/ring_test.c); otherwise they compile to
 * nothing. */
#define SHMQ_POINT_ANNOUNCED 1   /* announced, CAS not tried yet          */
#define SHMQ_POINT_LOST_CAS 2    /* CAS lost, announcement still in place */
#define SHMQ_POINT_WON_CAS 3     /* CAS won, not confirmed yet            */
#ifndef SHMQ_TEST_POINT
#define SHMQ_TEST_POINT(point) ((void)0)
#endif

#if defined(__x86_64__) || defined(__i386__)
#define SHMQ_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define SHMQ_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define SHMQ_CPU_RELAX() ((void)0)
#endif

/* ------------------------------------------------------------------------ */
/* Shared structures                                                         */
/* ------------------------------------------------------------------------ */

typedef struct shmq_slot {
    uint64_t owner;        /* (pid << 32) | state | flags.  CAS only.              */
    uint64_t starttime;    /* /proc/<pid>/stat field 22; guards against pid reuse;
                              0 while unknown (then pid alone decides)              */
    uint64_t claim_pos;    /* MPSC: position being claimed; written by the owner
                              before its CAS on tail_pos (relaxed, ordered by CAS) */
    uint64_t claim_bytes;  /* size of that claim, | SHMQ_CLAIM_OWNED once its CAS
                              won; 0 once published or withdrawn                  */
    uint64_t pending_since_ns; /* CLOCK_MONOTONIC when reserved for a fork child  */
    uint8_t _pad[SHMQ_CACHELINE - 40];
} shmq_slot;

typedef struct shmq_header {
    /* line 0: constants.  Written once by the creator; magic last (release). */
    uint64_t magic;
    uint32_t version;
    uint32_t flags;             /* SHMQ_FLAG_*                                  */
    uint64_t capacity_bytes;    /* power of two, SHMQ_MIN..MAX_CAPACITY         */
    uint64_t data_offset;       /* page aligned                                  */
    uint64_t slots_offset;
    uint64_t avail_offset;
    uint32_t max_attach;
    uint32_t creator_pid;
    uint64_t creator_starttime;

    /* line 1: written by producers only. */
    uint64_t tail_pos;          /* SPSC: published end; MPSC: claimed end       */
    uint8_t _pad1[SHMQ_CACHELINE - 8];

    /* line 2: written by the consumer only. */
    uint64_t head_pos;          /* everything below is consumed and free         */
    uint8_t _pad2[SHMQ_CACHELINE - 8];

    /* line 3: wake-ups.  Futex words are 32 bit. */
    uint32_t data_seq;          /* bumped by producers when consumer_waiting    */
    uint32_t consumer_waiting;  /* 0/1, written by the consumer                  */
    uint32_t space_seq;         /* bumped by the consumer when it wakes producers */
    uint32_t _reserved3;
    uint64_t space_wanted;      /* free bytes the waiting producers need (max of
                                   their announcements; 0 = nobody waits)       */
    uint8_t _pad3[SHMQ_CACHELINE - 24];

    /* line 4: control, rarely written. */
    int32_t consumer_slot;      /* slot index of the consumer, -1 none yet       */
    int32_t producer_slot;      /* SPSC: slot index of the producer, -1 none yet */
    uint32_t closed_writers;    /* potential producers that closed               */
    uint32_t gone_writers;      /* potential producers that died unclosed        */
    uint32_t skipped_records;   /* abandoned records the consumer dropped        */
    uint32_t _reserved4;
    /* A constant like line 0 (written once by the creator before the magic's
     * release store, read only after an acquire load of the magic), kept
     * here because line 0 is full.  Inode of the creator's /proc/self/ns/pid,
     * 0 if unknown: creator_pid and creator_starttime mean something only
     * in that pid namespace (NOTE [pid namespaces]). */
    uint64_t creator_pidns;
    uint8_t _pad4[SHMQ_CACHELINE - 32];
} shmq_header;

typedef struct shmq_record {
    uint64_t record_bytes;
    uint32_t kind;
    uint32_t nbuffers;
    uint64_t meta_bytes;
    uint32_t producer_pid;
    uint32_t reserved;
} shmq_record;

/* SHMQ_KIND_ARRAY metadata, followed by shape[ndim] (u64) and the dtype
 * string (numpy dtype.str, e.g. "<f8"), then padding; data at data_offset. */
typedef struct shmq_array_meta {
    uint32_t ndim;
    uint32_t dtype_chars;
    uint64_t data_offset;  /* from record start, multiple of 64 */
    uint64_t data_bytes;
} shmq_array_meta;

/* SHMQ_KIND_TREE metadata: the pickle stream, then nbuffers of these. */
typedef struct shmq_tree_meta {
    uint64_t pickle_offset;
    uint64_t pickle_bytes;
} shmq_tree_meta;

typedef struct shmq_buffer_entry {
    uint64_t offset;       /* from record start, multiple of 64 */
    uint64_t nbytes;
} shmq_buffer_entry;

_Static_assert(sizeof(shmq_slot) == SHMQ_CACHELINE, "slot is one cache line");
_Static_assert(offsetof(shmq_header, tail_pos) == 1 * SHMQ_CACHELINE, "tail line");
_Static_assert(offsetof(shmq_header, head_pos) == 2 * SHMQ_CACHELINE, "head line");
_Static_assert(offsetof(shmq_header, data_seq) == 3 * SHMQ_CACHELINE, "wake line");
_Static_assert(offsetof(shmq_header, consumer_slot) == 4 * SHMQ_CACHELINE, "control line");
_Static_assert(offsetof(shmq_header, creator_pidns) == 4 * SHMQ_CACHELINE + 24, "creator_pidns");
_Static_assert(sizeof(shmq_header) == 5 * SHMQ_CACHELINE, "header size");
_Static_assert(sizeof(shmq_record) == 32, "record header");
_Static_assert(sizeof(shmq_array_meta) == 24, "array meta");
_Static_assert(sizeof(shmq_tree_meta) == 16, "tree meta");
_Static_assert(sizeof(shmq_buffer_entry) == 16, "buffer entry");

/* ------------------------------------------------------------------------ */
/* Process-local handle (not shared)                                        */
/* ------------------------------------------------------------------------ */

typedef struct shmq_ring {
    shmq_header *hdr;
    shmq_slot *slots;
    uint32_t *avail;       /* NULL for SPSC */
    uint8_t *data;         /* first of the two consecutive data mappings */
    uint64_t capacity;
    uint64_t mask;
    unsigned cap_shift;    /* log2(capacity) */
    int mpsc;
    int32_t slot;          /* this handle's slot, -1 none */
    uint64_t cached_head;  /* producer side: last head_pos seen */
    uint64_t cached_tail;  /* consumer side: last tail_pos seen */
    uint32_t read_spin_misses;  /* consecutive waits a spin did not satisfy */
    uint32_t write_spin_misses;
    /* The last SHMQ_CORRUPT: which field, the value read, the limit it broke
     * (for the error message; see NOTE [validation]). */
    int bad_field;
    uint64_t bad_value;
    uint64_t bad_limit;
} shmq_ring;

static inline uint64_t shmq_align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

static inline uint64_t shmq_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Offsets of each region for a ring of this shape; the segment is
 * data_offset + capacity bytes long. */
static inline void shmq_layout(uint64_t capacity, int mpsc, uint32_t max_attach,
                               uint64_t *slots_offset, uint64_t *avail_offset,
                               uint64_t *data_offset) {
    uint64_t slots = shmq_align_up(sizeof(shmq_header), SHMQ_CACHELINE);
    uint64_t avail = slots + (uint64_t)max_attach * sizeof(shmq_slot);
    uint64_t avail_bytes = mpsc ? (capacity / SHMQ_RECORD_ALIGN) * sizeof(uint32_t) : 0;
    *slots_offset = slots;
    *avail_offset = avail;
    *data_offset = shmq_align_up(avail + avail_bytes, SHMQ_PAGE);
}

static inline int shmq_is_pow2(uint64_t x) { return x && !(x & (x - 1)); }

/* Record a failed check in the handle (NOTE [validation]); returns
 * SHMQ_CORRUPT so callers can `return shmq_corrupt(...)`. */
static inline int shmq_corrupt(shmq_ring *r, int field, uint64_t value, uint64_t limit) {
    r->bad_field = field;
    r->bad_value = value;
    r->bad_limit = limit;
    return SHMQ_CORRUPT;
}

/* A (head, tail) pair just read from the header is usable: at most a ring's
 * worth apart, head not past tail (unsigned subtraction wraps otherwise),
 * both at record boundaries.  Two compares; see NOTE [validation]. */
static inline int shmq_positions_ok(uint64_t capacity, uint64_t head, uint64_t tail) {
    return tail - head <= capacity && ((head | tail) & (SHMQ_RECORD_ALIGN - 1)) == 0;
}

/* Read head and tail of a header that others are changing, for a process
 * that owns neither (an MPSC producer, an attacher), and check them.  Two
 * plain loads are not a pair: with producers claiming and the consumer
 * freeing in between, tail can be more than capacity ahead of a head read
 * a moment earlier (a claimer saw a newer head), and a valid ring would
 * look corrupt.  So head is read on both sides of tail, again while it
 * moves: when it did not move, (head, tail) existed at one instant and the
 * strict check applies.  If it never holds still, only what holds across
 * instants is checked: head1 <= tail <= head2 + capacity.  Returns 1 if
 * the positions pass; *head, *tail get the values read. */
static inline int shmq_positions_read(const shmq_header *h, uint64_t capacity, uint64_t *head,
                                      uint64_t *tail) {
    uint64_t h1 = 0, t = 0, h2 = 0;
    for (int i = 0; i < 16; i++) {
        h1 = __atomic_load_n(&h->head_pos, __ATOMIC_ACQUIRE);
        t = __atomic_load_n(&h->tail_pos, __ATOMIC_ACQUIRE);
        h2 = __atomic_load_n(&h->head_pos, __ATOMIC_ACQUIRE);
        if (h1 == h2) break;
    }
    *head = h2;
    *tail = t;
    if (h1 == h2) return shmq_positions_ok(capacity, h2, t);
    return t >= h1 && ((h1 | h2 | t) & (SHMQ_RECORD_ALIGN - 1)) == 0 && (t <= h2 || t - h2 <= capacity);
}

static inline unsigned shmq_log2(uint64_t x) {
    unsigned s = 0;
    while ((1ULL << s) < x) s++;
    return s;
}

/* ------------------------------------------------------------------------ */
/* Process liveness (Linux /proc)                                            */
/* ------------------------------------------------------------------------ */

/* Returned by shmq_proc_starttime for a process that exists but whose
 * /proc entry this process cannot read now (no file descriptor left, no
 * memory): alive, start time unknown.  Taking it for dead would retire a
 * live peer for good (a consumer at its fd limit saw PeerLost). */
#define SHMQ_STARTTIME_UNKNOWN UINT64_MAX

/* Start time (clock ticks since boot) of a live, non-zombie process, 0 if
 * there is no such process, or SHMQ_STARTTIME_UNKNOWN (see above).  A
 * zombie counts as dead: a SIGKILLed child that its parent has not reaped
 * yet must not keep a queue open. */
static inline uint64_t shmq_proc_starttime(uint32_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ESRCH) return 0;
        /* Out of fds or memory: ask the kernel without a file.  EPERM
         * still means the process exists. */
        return (kill((pid_t)pid, 0) == 0 || errno == EPERM) ? SHMQ_STARTTIME_UNKNOWN : 0;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    /* comm may hold spaces and ')' : fields resume after the LAST ')' */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    p += 2;
    char state = *p;
    if (state == 'Z' || state == 'X' || state == 'x') return 0;
    /* p points at field 3; starttime is field 22 */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    uint64_t st = strtoull(p, NULL, 10);
    return st ? st : 1; /* a live process never reports 0 */
}

/* NOTE [pid namespaces]
 *   Containers of one Kubernetes pod, or `docker run --ipc=host`, share
 *   /dev/shm but not pids: pid 7 in the creator's namespace is another
 *   process, or none, in the reader's.  Liveness by pid (slots, the
 *   creator) is only meaningful inside one namespace, so the creator
 *   records its namespace (the inode of /proc/self/ns/pid, unique while the
 *   namespace exists) and `python -m shmq clean` removes a segment only if
 *   its namespace is the cleaner's and its creator is gone there; any other
 *   segment is "unknown: other pid namespace" and needs --force.  Processes
 *   that share a queue are assumed to share a pid namespace (forked
 *   children, or attach() within one container).
 *
 * The caller's pid namespace, or 0 if /proc does not say (not mounted). */
static inline uint64_t shmq_self_pidns(void) {
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0) return 0;
    return (uint64_t)st.st_ino;
}

static inline int shmq_owner_alive(const shmq_slot *s, uint64_t owner) {
    uint32_t pid = (uint32_t)(owner >> 32);
    if (owner & SHMQ_SLOT_PENDING) {
        /* Reserved by pid for a process that has not adopted it yet. */
        uint64_t since = __atomic_load_n(&s->pending_since_ns, __ATOMIC_RELAXED);
        if (shmq_now_ns() - since > SHMQ_PENDING_ADOPT_NS) return 0;
        return shmq_proc_starttime(pid) != 0;
    }
    uint64_t want = __atomic_load_n(&s->starttime, __ATOMIC_RELAXED);
    uint64_t have = shmq_proc_starttime(pid);
    if (!have) return 0;
    return want == 0 || want == have || have == SHMQ_STARTTIME_UNKNOWN;
}

/* ------------------------------------------------------------------------ */
/* Creation, validation, binding                                             */
/* ------------------------------------------------------------------------ */

/* Initialise a zero-filled segment.  Magic is stored last with release
 * order, so an attacher that sees the magic sees every other constant. */
static inline void shmq_init(void *base, uint64_t capacity, int mpsc, uint32_t creator_pid,
                             uint64_t creator_starttime, uint64_t creator_pidns) {
    shmq_header *h = (shmq_header *)base;
    uint64_t so, ao, dof;
    shmq_layout(capacity, mpsc, SHMQ_MAX_ATTACH, &so, &ao, &dof);
    h->version = SHMQ_VERSION;
    h->flags = mpsc ? SHMQ_FLAG_MPSC : 0;
    h->capacity_bytes = capacity;
    h->data_offset = dof;
    h->slots_offset = so;
    h->avail_offset = ao;
    h->max_attach = SHMQ_MAX_ATTACH;
    h->creator_pid = creator_pid;
    h->creator_starttime = creator_starttime;
    h->creator_pidns = creator_pidns;
    h->consumer_slot = -1;
    h->producer_slot = -1;
    __atomic_store_n(&h->magic, SHMQ_MAGIC, __ATOMIC_RELEASE);
}

/* Check a mapped header against the file it came from.  Returns SHMQ_OK or
 * SHMQ_CORRUPT with *bad_field set.  Reads only the first
 * sizeof(shmq_header) bytes, which the caller has mapped after checking the
 * file is at least that long.  live: base is the shared mapping, so the
 * positions are checked too (shmq_positions_read); a private copy made by
 * read() while others ran can hold a head and a tail from different
 * instants, so its positions prove nothing either way. */
static inline int shmq_validate(const void *base, uint64_t file_bytes, int live, int *bad_field) {
    const shmq_header *h = (const shmq_header *)base;
    uint64_t so, ao, dof;
    *bad_field = SHMQ_FIELD_NONE;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHMQ_MAGIC) { *bad_field = SHMQ_FIELD_MAGIC; return SHMQ_CORRUPT; }
    if (h->version != SHMQ_VERSION) { *bad_field = SHMQ_FIELD_VERSION; return SHMQ_CORRUPT; }
    if (h->flags & ~SHMQ_FLAG_MPSC) { *bad_field = SHMQ_FIELD_FLAGS; return SHMQ_CORRUPT; }
    if (!shmq_is_pow2(h->capacity_bytes) || h->capacity_bytes < SHMQ_MIN_CAPACITY ||
        h->capacity_bytes > SHMQ_MAX_CAPACITY) { *bad_field = SHMQ_FIELD_CAPACITY; return SHMQ_CORRUPT; }
    if (h->max_attach != SHMQ_MAX_ATTACH) { *bad_field = SHMQ_FIELD_MAX_ATTACH; return SHMQ_CORRUPT; }
    shmq_layout(h->capacity_bytes, (h->flags & SHMQ_FLAG_MPSC) != 0, h->max_attach, &so, &ao, &dof);
    if (h->slots_offset != so || h->avail_offset != ao || h->data_offset != dof) {
        *bad_field = SHMQ_FIELD_OFFSETS; return SHMQ_CORRUPT;
    }
    if (file_bytes != dof + h->capacity_bytes) { *bad_field = SHMQ_FIELD_FILE_SIZE; return SHMQ_CORRUPT; }
    uint64_t head, tail;
    if (live && !shmq_positions_read(h, h->capacity_bytes, &head, &tail)) {
        *bad_field = SHMQ_FIELD_POSITIONS; return SHMQ_CORRUPT;
    }
    int32_t c = __atomic_load_n(&h->consumer_slot, __ATOMIC_ACQUIRE);
    int32_t p = __atomic_load_n(&h->producer_slot, __ATOMIC_ACQUIRE);
    if (c < -1 || c >= (int32_t)SHMQ_MAX_ATTACH) { *bad_field = SHMQ_FIELD_CONSUMER_SLOT; return SHMQ_CORRUPT; }
    if (p < -1 || p >= (int32_t)SHMQ_MAX_ATTACH) { *bad_field = SHMQ_FIELD_PRODUCER_SLOT; return SHMQ_CORRUPT; }
    return SHMQ_OK;
}

/* Fill a local handle.  base is the start of the mapping; the data region
 * must be mapped twice, at base + data_offset and right after it.  capacity
 * and mpsc are the values the caller validated and mapped by (shmq_validate
 * on a private copy of the header, or what it created): the header itself
 * may have changed since, so its geometry fields are not read here, nor
 * ever again (NOTE [validation]). */
static inline void shmq_bind(shmq_ring *r, void *base, uint64_t capacity, int mpsc) {
    shmq_header *h = (shmq_header *)base;
    uint64_t so, ao, dof;
    shmq_layout(capacity, mpsc, SHMQ_MAX_ATTACH, &so, &ao, &dof);
    r->hdr = h;
    r->slots = (shmq_slot *)((uint8_t *)base + so);
    r->mpsc = mpsc != 0;
    r->avail = r->mpsc ? (uint32_t *)((uint8_t *)base + ao) : NULL;
    r->data = (uint8_t *)base + dof;
    r->capacity = capacity;
    r->mask = capacity - 1;
    r->cap_shift = shmq_log2(capacity);
    r->slot = -1;
    r->bad_field = SHMQ_FIELD_NONE;
    r->bad_value = r->bad_limit = 0;
    r->cached_head = __atomic_load_n(&h->head_pos, __ATOMIC_ACQUIRE);
    r->cached_tail = r->cached_head;
    r->read_spin_misses = r->write_spin_misses = 0;
}

static inline uint8_t *shmq_at(const shmq_ring *r, uint64_t pos) { return r->data + (pos & r->mask); }

/* ------------------------------------------------------------------------ */
/* Attachment slots                                                          */
/* ------------------------------------------------------------------------ */

/* A slot may be taken over when it is free, closed, or its owner is dead and
 * holds no claim the consumer has not yet passed.  The registered
 * consumer's slot is never taken over: it is how producers learn that the
 * consumer closed or died (only shmq_take_role replaces a dead consumer). */
static inline int shmq_slot_reusable(const shmq_ring *r, uint32_t i, const shmq_slot *s,
                                     uint64_t owner) {
    if ((int32_t)i == __atomic_load_n(&r->hdr->consumer_slot, __ATOMIC_ACQUIRE)) return 0;
    uint32_t st = (uint32_t)owner & SHMQ_SLOT_STATE_MASK;
    if (st == SHMQ_SLOT_FREE || st == SHMQ_SLOT_CLOSED) return 1;
    if (st == SHMQ_SLOT_OPEN && shmq_owner_alive(s, owner)) return 0;
    /* OPEN but dead, or GONE: its claim must be resolved (head past it). */
    uint64_t cb = __atomic_load_n(&s->claim_bytes, __ATOMIC_RELAXED);
    uint64_t cp = __atomic_load_n(&s->claim_pos, __ATOMIC_RELAXED);
    uint64_t head = __atomic_load_n(&r->hdr->head_pos, __ATOMIC_ACQUIRE);
    return cb == 0 || head > cp;
}

/* Take a slot for (pid, flags).  Returns the slot index or -1 if every slot
 * is held by a live handle. */
static inline int32_t shmq_slot_acquire(shmq_ring *r, uint32_t pid, uint64_t starttime,
                                        uint32_t flags) {
    for (uint32_t i = 0; i < SHMQ_MAX_ATTACH; i++) { /* never hdr->max_attach */
        shmq_slot *s = &r->slots[i];
        uint64_t old = __atomic_load_n(&s->owner, __ATOMIC_ACQUIRE);
        if (!shmq_slot_reusable(r, i, s, old)) continue;
        /* A dead-but-OPEN owner is first retired as GONE so it is counted. */
        uint32_t st = (uint32_t)old & SHMQ_SLOT_STATE_MASK;
        uint64_t mine = ((uint64_t)pid << 32) | flags;
        if (!__atomic_compare_exchange_n(&s->owner, &old, mine, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        if (st == SHMQ_SLOT_OPEN && !((uint32_t)old & SHMQ_SLOT_CONSUMER))
            __atomic_fetch_add(&r->hdr->gone_writers, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&s->claim_bytes, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&s->pending_since_ns, (flags & SHMQ_SLOT_PENDING) ? shmq_now_ns() : 0,
                         __ATOMIC_RELAXED);
        __atomic_store_n(&s->starttime, starttime, __ATOMIC_RELEASE);
        return (int32_t)i;
    }
    return -1;
}

/* Replace the owner of a slot this handle holds (used for set/clear of
 * flags and for a child adopting a slot its parent reserved).  Returns 1 if
 * the slot was still in the expected state. */
static inline int shmq_slot_update(shmq_ring *r, int32_t i, uint64_t expect, uint64_t desired) {
    return __atomic_compare_exchange_n(&r->slots[i].owner, &expect, desired, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_RELAXED);
}

static inline uint64_t shmq_slot_owner(const shmq_ring *r, int32_t i) {
    return __atomic_load_n(&r->slots[i].owner, __ATOMIC_ACQUIRE);
}

static inline int shmq_is_writer(uint64_t owner) {
    /* A pure consumer is not a potential producer; one that also wrote is. */
    return !(owner & SHMQ_SLOT_CONSUMER) || (owner & SHMQ_SLOT_PRODUCED);
}

/* Close this handle's slot.  Counts it as a closed writer when it was a
 * potential producer. */
static inline void shmq_slot_close(shmq_ring *r, int32_t i) {
    uint64_t old = shmq_slot_owner(r, i);
    for (;;) {
        if (((uint32_t)old & SHMQ_SLOT_STATE_MASK) != SHMQ_SLOT_OPEN) return;
        uint64_t closed = (old & ~(uint64_t)SHMQ_SLOT_STATE_MASK & ~(uint64_t)SHMQ_SLOT_PENDING) |
                          SHMQ_SLOT_CLOSED;
        if (__atomic_compare_exchange_n(&r->slots[i].owner, &old, closed, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            break;
    }
    if (shmq_is_writer(old)) __atomic_fetch_add(&r->hdr->closed_writers, 1, __ATOMIC_RELEASE);
    /* Wake everyone: they re-check peers on wake-up. */
    __atomic_fetch_add(&r->hdr->data_seq, 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&r->hdr->space_seq, 1, __ATOMIC_SEQ_CST);
    shmq_word_wake(&r->hdr->data_seq, SHMQ_WAKE_ALL);
    shmq_word_wake(&r->hdr->space_seq, SHMQ_WAKE_ALL);
}

/* If this OPEN owner is dead, retire it as GONE (once, by CAS) and count it. */
static inline int shmq_retire_if_dead(shmq_ring *r, uint32_t i, uint64_t owner) {
    if (shmq_owner_alive(&r->slots[i], owner)) return 0;
    uint64_t gone = (owner & ~(uint64_t)SHMQ_SLOT_STATE_MASK) | SHMQ_SLOT_GONE;
    if (__atomic_compare_exchange_n(&r->slots[i].owner, &owner, gone, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED) && shmq_is_writer(owner))
        __atomic_fetch_add(&r->hdr->gone_writers, 1, __ATOMIC_RELEASE);
    return 1;
}

/* Called by the consumer while the ring is empty: may anyone still write? */
static inline int shmq_writers_status(shmq_ring *r) {
    shmq_header *h = r->hdr;
    for (uint32_t i = 0; i < SHMQ_MAX_ATTACH; i++) { /* never hdr->max_attach */
        uint64_t o = __atomic_load_n(&r->slots[i].owner, __ATOMIC_ACQUIRE);
        if (((uint32_t)o & SHMQ_SLOT_STATE_MASK) != SHMQ_SLOT_OPEN || !shmq_is_writer(o)) continue;
        if (!shmq_retire_if_dead(r, i, o)) return SHMQ_PEERS_OPEN;
    }
    uint32_t gone = __atomic_load_n(&h->gone_writers, __ATOMIC_ACQUIRE);
    uint32_t closed = __atomic_load_n(&h->closed_writers, __ATOMIC_ACQUIRE);
    if (gone) return SHMQ_PEERS_LOST;
    if (closed) return SHMQ_PEERS_CLOSED;
    return SHMQ_PEERS_OPEN; /* nobody has attached to write yet: wait for one */
}

/* Called by a producer while the ring is full: can anyone still read?  With
 * no consumer registered yet the answer is "keep waiting".  SHMQ_CORRUPT if
 * consumer_slot is not a slot index. */
static inline int shmq_reader_status(shmq_ring *r) {
    int32_t c = __atomic_load_n(&r->hdr->consumer_slot, __ATOMIC_ACQUIRE);
    if (c == -1) return SHMQ_PEERS_OPEN;
    if (c < -1 || c >= (int32_t)SHMQ_MAX_ATTACH)
        return shmq_corrupt(r, SHMQ_FIELD_CONSUMER_SLOT, (uint64_t)(int64_t)c, SHMQ_MAX_ATTACH);
    uint64_t o = __atomic_load_n(&r->slots[c].owner, __ATOMIC_ACQUIRE);
    uint32_t st = (uint32_t)o & SHMQ_SLOT_STATE_MASK;
    if (!(o & SHMQ_SLOT_CONSUMER)) return SHMQ_PEERS_OPEN; /* slot changing hands */
    if (st == SHMQ_SLOT_CLOSED) return SHMQ_PEERS_CLOSED;
    if (st == SHMQ_SLOT_GONE) return SHMQ_PEERS_LOST;
    if (st == SHMQ_SLOT_OPEN && shmq_retire_if_dead(r, (uint32_t)c, o)) return SHMQ_PEERS_LOST;
    return SHMQ_PEERS_OPEN;
}

/* Make slot `i` the holder of an exclusive role: the consumer
 * (role_slot = &hdr->consumer_slot, flag SHMQ_SLOT_CONSUMER) or the one
 * producer of an SPSC ring (&hdr->producer_slot, SHMQ_SLOT_PRODUCED).
 * Returns -1 on success, the pid of the handle that holds the role, or
 * SHMQ_ROLE_CORRUPT when the role slot is not a slot index (r->bad_field
 * names it).  A dead holder is replaced; a holder that closed is replaced
 * only when replace_closed is set: a consumer that closed told producers
 * the stream ended, so the consumer role is not handed on. */
#define SHMQ_ROLE_CORRUPT (-2)
static inline int64_t shmq_take_role(shmq_ring *r, int32_t *role_slot, int32_t i, uint64_t flag,
                                     int replace_closed) {
    for (;;) {
        int32_t c = __atomic_load_n(role_slot, __ATOMIC_ACQUIRE);
        if (c == i) break;
        if (c < -1 || c >= (int32_t)SHMQ_MAX_ATTACH) {
            shmq_corrupt(r, role_slot == &r->hdr->consumer_slot ? SHMQ_FIELD_CONSUMER_SLOT
                                                                : SHMQ_FIELD_PRODUCER_SLOT,
                         (uint64_t)(int64_t)c, SHMQ_MAX_ATTACH);
            return SHMQ_ROLE_CORRUPT;
        }
        if (c >= 0) {
            uint64_t o = __atomic_load_n(&r->slots[c].owner, __ATOMIC_ACQUIRE);
            uint32_t st = (uint32_t)o & SHMQ_SLOT_STATE_MASK;
            if (o & flag) {
                if (st == SHMQ_SLOT_OPEN && !shmq_retire_if_dead(r, (uint32_t)c, o)) return (int64_t)(o >> 32);
                if (st == SHMQ_SLOT_CLOSED && !replace_closed) return (int64_t)(o >> 32);
            }
        }
        if (__atomic_compare_exchange_n(role_slot, &c, i, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) break;
    }
    for (;;) {
        uint64_t o = shmq_slot_owner(r, i);
        if (shmq_slot_update(r, i, o, o | flag)) break;
    }
    r->cached_tail = __atomic_load_n(&r->hdr->tail_pos, __ATOMIC_ACQUIRE);
    r->cached_head = __atomic_load_n(&r->hdr->head_pos, __ATOMIC_ACQUIRE);
    return -1;
}

/* ------------------------------------------------------------------------ */
/* Producer                                                                  */
/* ------------------------------------------------------------------------ */

/* Is there room for `need` (<= capacity) bytes at *tail?  SHMQ_OK, SHMQ_FULL,
 * or SHMQ_CORRUPT when the positions fail NOTE [validation].  The fast
 * path is one unsigned compare against the cached head; it also fails for a
 * tail behind head, which then gets the full check. */
static inline int shmq_has_space(shmq_ring *r, uint64_t *tail, uint64_t need) {
    if (*tail - r->cached_head <= r->capacity - need) return SHMQ_OK;
    uint64_t head;
    if (r->mpsc) {
        /* *tail may be a stale snapshot the consumer has passed since, and
         * other producers move tail while we look: read the pair afresh
         * (the caller's CAS expects the fresh tail anyway). */
        if (!shmq_positions_read(r->hdr, r->capacity, &head, tail))
            return shmq_corrupt(r, SHMQ_FIELD_POSITIONS, head, *tail);
        r->cached_head = head;
        return *tail >= head && *tail - head <= r->capacity - need ? SHMQ_OK : SHMQ_FULL;
    }
    /* SPSC: tail is ours, so head read now pairs with it. */
    head = __atomic_load_n(&r->hdr->head_pos, __ATOMIC_ACQUIRE);
    r->cached_head = head;
    if (!shmq_positions_ok(r->capacity, head, *tail))
        return shmq_corrupt(r, SHMQ_FIELD_POSITIONS, head, *tail);
    return *tail - head <= r->capacity - need ? SHMQ_OK : SHMQ_FULL;
}

/* Claim `need` bytes (a multiple of 64, <= capacity).  On SHMQ_OK, *pos is
 * where the record goes; the caller fills [*pos, *pos+need) via shmq_at()
 * and then calls shmq_publish.  SHMQ_FULL, or SHMQ_CORRUPT (positions). */
static inline int shmq_claim(shmq_ring *r, uint64_t need, uint64_t *pos) {
    shmq_header *h = r->hdr;
    int rc;
    if (!r->mpsc) {
        /* Single producer: tail_pos is ours.  Acquire, not relaxed, because
         * the role may have been handed over by a producer that closed. */
        uint64_t t = __atomic_load_n(&h->tail_pos, __ATOMIC_ACQUIRE);
        if ((rc = shmq_has_space(r, &t, need)) != SHMQ_OK) return rc;
        *pos = t;
        return SHMQ_OK;
    }
    /* See NOTE [claim announcement] for every step below. */
    shmq_slot *s = &r->slots[r->slot];
    uint64_t t = __atomic_load_n(&h->tail_pos, __ATOMIC_RELAXED);
    int announced = 0;
    for (;;) {
        if ((rc = shmq_has_space(r, &t, need)) != SHMQ_OK) {
            /* WITHDRAW: a lost CAS must not leave its announcement behind. */
            if (announced) __atomic_store_n(&s->claim_bytes, 0, __ATOMIC_RELAXED);
            return rc;
        }
        /* ANNOUNCE before the CAS, so that if this process dies right after
         * the CAS the consumer can find and skip the record.  Release on
         * claim_pos orders it after our previous publish/withdraw (0 in
         * claim_bytes); release on claim_bytes orders claim_pos before it
         * (the consumer reads claim_bytes, claim_pos, claim_bytes again).
         * The CAS (seq_cst) orders both before the new tail is visible. */
        __atomic_store_n(&s->claim_pos, t, __ATOMIC_RELEASE);
        __atomic_store_n(&s->claim_bytes, need, __ATOMIC_RELEASE);
        announced = 1;
        SHMQ_TEST_POINT(SHMQ_POINT_ANNOUNCED);
        if (__atomic_compare_exchange_n(&h->tail_pos, &t, t + need, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
            break;
        SHMQ_TEST_POINT(SHMQ_POINT_LOST_CAS);
        /* t now holds the current tail: room there?  announce again, or withdraw */
    }
    SHMQ_TEST_POINT(SHMQ_POINT_WON_CAS);
    /* CONFIRM: [t, t+need) is ours; the consumer trusts this one over any
     * other announcement of t (rule 1). */
    __atomic_store_n(&s->claim_bytes, need | SHMQ_CLAIM_OWNED, __ATOMIC_RELEASE);
    *pos = t;
    return SHMQ_OK;
}

static inline uint32_t shmq_lap_tag(const shmq_ring *r, uint64_t pos) {
    /* +1 so that the zero-filled initial array never matches lap 0 */
    return (uint32_t)(pos >> r->cap_shift) + 1u;
}

static inline void shmq_wake_consumer(shmq_ring *r) {
    shmq_header *h = r->hdr;
    /* Pairs with the fence in shmq_wait_readable: see "Waiting" above. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&h->consumer_waiting, __ATOMIC_RELAXED)) {
        __atomic_fetch_add(&h->data_seq, 1, __ATOMIC_SEQ_CST);
        shmq_word_wake(&h->data_seq, 1);
    }
}

/* Make the record at pos visible.  The record header must be complete. */
static inline void shmq_publish(shmq_ring *r, uint64_t pos, uint64_t need) {
    if (!r->mpsc) {
        __atomic_store_n(&r->hdr->tail_pos, pos + need, __ATOMIC_RELEASE);
    } else {
        __atomic_store_n(&r->avail[(pos & r->mask) / SHMQ_RECORD_ALIGN], shmq_lap_tag(r, pos),
                         __ATOMIC_RELEASE);
        __atomic_store_n(&r->slots[r->slot].claim_bytes, 0, __ATOMIC_RELAXED);
    }
    shmq_wake_consumer(r);
}

/* ------------------------------------------------------------------------ */
/* Consumer                                                                  */
/* ------------------------------------------------------------------------ */

/* Look at the record at head.  SHMQ_OK: *pos and *bytes describe a published
 * record whose length has been checked against the ring.  SHMQ_CORRUPT: they
 * hold the head and the invalid length, for the error message. */
/* Look at the record at head.  SHMQ_OK: *pos and *bytes describe a published
 * record whose length has been checked against the ring.  SHMQ_CORRUPT:
 * the positions or the length fail NOTE [validation] (r->bad_field says
 * which); *pos holds the head. */
static inline int shmq_peek(shmq_ring *r, uint64_t *pos, uint64_t *bytes) {
    shmq_header *h = r->hdr;
    /* Ours, but shared memory all the same: checked below before use. */
    uint64_t head = __atomic_load_n(&h->head_pos, __ATOMIC_RELAXED);
    *pos = head;
    if (head == r->cached_tail) {
        r->cached_tail = __atomic_load_n(&h->tail_pos, __ATOMIC_ACQUIRE);
        if (head == r->cached_tail) return SHMQ_EMPTY;
    }
    if (!shmq_positions_ok(r->capacity, head, r->cached_tail)) {
        /* The cached tail can be behind a head that skipped a dead
         * producer's record (its size was checked against a fresher tail):
         * read it again before calling the positions corrupt. */
        r->cached_tail = __atomic_load_n(&h->tail_pos, __ATOMIC_ACQUIRE);
        if (head == r->cached_tail) return SHMQ_EMPTY;
        if (!shmq_positions_ok(r->capacity, head, r->cached_tail))
            return shmq_corrupt(r, SHMQ_FIELD_POSITIONS, head, r->cached_tail);
    }
    if (r->mpsc) {
        uint32_t tag = __atomic_load_n(&r->avail[(head & r->mask) / SHMQ_RECORD_ALIGN], __ATOMIC_ACQUIRE);
        if (tag != shmq_lap_tag(r, head)) return SHMQ_PENDING;
    }
    const shmq_record *rec = (const shmq_record *)shmq_at(r, head);
    uint64_t n = __atomic_load_n(&rec->record_bytes, __ATOMIC_RELAXED);
    *bytes = n;
    if (n < sizeof(shmq_record) || (n & (SHMQ_RECORD_ALIGN - 1)) || n > r->cached_tail - head)
        return shmq_corrupt(r, SHMQ_FIELD_RECORD_BYTES, n, r->cached_tail - head);
    return SHMQ_OK;
}

/* Waiting producers are woken in batches: only once the free space reaches
 * what they announced, and at least 1/8 of the ring.  Waking them on every
 * release would wake every waiter per message, and with more processes than
 * cores they would take the CPU the consumer needs to make room at all.  The
 * batch cannot stall: draining the ring frees all of it. */
static inline void shmq_wake_producers(shmq_ring *r, uint64_t head) {
    shmq_header *h = r->hdr;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* pairs with shmq_wait_writable */
    uint64_t wanted = __atomic_load_n(&h->space_wanted, __ATOMIC_RELAXED);
    if (!wanted) return;
    uint64_t floor = r->capacity / 8;
    uint64_t free_bytes = r->capacity - (__atomic_load_n(&h->tail_pos, __ATOMIC_ACQUIRE) - head);
    if (free_bytes < (wanted > floor ? wanted : floor) && free_bytes < r->capacity) return;
    if (__atomic_exchange_n(&h->space_wanted, 0, __ATOMIC_SEQ_CST)) {
        __atomic_fetch_add(&h->space_seq, 1, __ATOMIC_SEQ_CST);
        shmq_word_wake(&h->space_seq, SHMQ_WAKE_ALL);
    }
}

/* Free the record at pos (must be head) for reuse. */
static inline void shmq_release(shmq_ring *r, uint64_t pos, uint64_t bytes) {
    __atomic_store_n(&r->hdr->head_pos, pos + bytes, __ATOMIC_RELEASE);
    shmq_wake_producers(r, pos + bytes);
}

/* MPSC, head (the *pos shmq_peek gave) is claimed but unpublished (shmq_peek
 * said SHMQ_PENDING, and a wait slice passed): who claimed it, and are they
 * alive?  The rules are
 * NOTE [claim announcement].  Returns
 *   SHMQ_ABANDONED  its producer died: skip *skip_bytes (the caller releases
 *                   them), *dead_pid says who
 *   SHMQ_PENDING    keep waiting (someone alive is writing or deciding)
 *   SHMQ_AMBIGUOUS  dead announcers disagree on the size: the next record
 *                   cannot be located
 *   SHMQ_CORRUPT    the claim or the positions fail NOTE [validation] */
static inline int shmq_resolve_pending(shmq_ring *r, uint64_t head, uint64_t *skip_bytes,
                                       uint32_t *dead_pid) {
    shmq_header *h = r->hdr;
    uint64_t owned = 0, tentative = 0;
    uint32_t owned_pid = 0, tentative_pid = 0, owned_slot = 0, tentative_slot = 0;
    int live_tentative = 0, disagree = 0;
    for (uint32_t i = 0; i < SHMQ_MAX_ATTACH; i++) { /* never hdr->max_attach */
        shmq_slot *s = &r->slots[i];
        uint64_t o = __atomic_load_n(&s->owner, __ATOMIC_ACQUIRE);
        uint32_t st = (uint32_t)o & SHMQ_SLOT_STATE_MASK;
        if (st == SHMQ_SLOT_FREE) continue;
        /* claim_bytes, claim_pos, claim_bytes again (acquire pairs with the
         * producer's release stores): if claim_bytes changed, the pair may
         * mix two announcements, and its owner is active right now. */
        uint64_t cb = __atomic_load_n(&s->claim_bytes, __ATOMIC_ACQUIRE);
        uint64_t cp = __atomic_load_n(&s->claim_pos, __ATOMIC_ACQUIRE);
        uint64_t cb_again = __atomic_load_n(&s->claim_bytes, __ATOMIC_RELAXED);
        uint64_t size = cb & ~SHMQ_CLAIM_OWNED;
        if (size == 0 || cp != head) continue;
        int alive = cb != cb_again || (st == SHMQ_SLOT_OPEN && !shmq_retire_if_dead(r, i, o));
        if (cb != cb_again) cb &= ~SHMQ_CLAIM_OWNED; /* in motion: at most tentative */
        if (cb & SHMQ_CLAIM_OWNED) {
            if (alive) return SHMQ_PENDING;             /* rule 1: it is writing */
            if (owned && owned != size)                 /* two won CASes from one tail */
                return shmq_corrupt(r, SHMQ_FIELD_CLAIM, size, i);
            owned = size;
            owned_pid = (uint32_t)(o >> 32);
            owned_slot = i;
        } else if (alive) {
            live_tentative = 1;                         /* rule 2, unless an OWNED one turns up */
        } else {
            if (tentative && tentative != size) disagree = 1;
            tentative = size;
            tentative_pid = (uint32_t)(o >> 32);
            tentative_slot = i;
        }
    }
    uint64_t size;
    uint32_t pid, slot;
    if (owned) {
        size = owned, pid = owned_pid, slot = owned_slot;       /* rule 1 */
    } else if (live_tentative || !tentative) {
        return SHMQ_PENDING;                                    /* rules 2 and 4 */
    } else if (disagree) {
        return SHMQ_AMBIGUOUS;                                  /* rule 3 */
    } else {
        size = tentative, pid = tentative_pid, slot = tentative_slot;
    }
    uint64_t tail = __atomic_load_n(&h->tail_pos, __ATOMIC_ACQUIRE);
    if (!shmq_positions_ok(r->capacity, head, tail))
        return shmq_corrupt(r, SHMQ_FIELD_POSITIONS, head, tail);
    if ((size & (SHMQ_RECORD_ALIGN - 1)) || size > tail - head)
        return shmq_corrupt(r, SHMQ_FIELD_CLAIM, size, slot);
    /* Published after all (its producer died after publishing, before
     * clearing its claim)?  Then it is delivered, not skipped. */
    if (__atomic_load_n(&r->avail[(head & r->mask) / SHMQ_RECORD_ALIGN], __ATOMIC_ACQUIRE) ==
        shmq_lap_tag(r, head))
        return SHMQ_PENDING;
    *skip_bytes = size;
    *dead_pid = pid;
    __atomic_fetch_add(&h->skipped_records, 1, __ATOMIC_RELAXED);
    return SHMQ_ABANDONED;
}

/* ------------------------------------------------------------------------ */
/* Waiting                                                                   */
/* ------------------------------------------------------------------------ */

/* How long a waiter spins before it sleeps on the futex.  Spinning saves
 * the ~5-50 us of a sleep/wake round trip when the other side is about to
 * act, but steals a core from it when processes outnumber cores, so only
 * the first waiter on a side spins, and only this long.  Spinning is also
 * adaptive per handle: after SHMQ_SPIN_MAX_MISSES waits in a row that the
 * spin did not satisfy (a consumer whose messages come milliseconds apart),
 * the handle sleeps at once, and spins again as soon as a wait turns out to
 * be shorter than the spin window.  On virtual machines a pause loop can
 * cost several times its nominal length. */
#define SHMQ_SPIN_NS 20000ULL
#define SHMQ_SPIN_MAX_MISSES 4u

/* Spin until ready_expr holds -- then RETURN SHMQ_OK from the enclosing
 * function -- or SHMQ_SPIN_NS passed (count a miss, fall through to the
 * futex).  The clock is read every 64 pauses because a pause lasts 10-150
 * cycles depending on the CPU. */
#define SHMQ_SPIN_UNTIL(ready_expr, misses)                                      \
    do {                                                                         \
        uint64_t spin_end_ = shmq_now_ns() + SHMQ_SPIN_NS;                       \
        for (unsigned spin_i_ = 1;; spin_i_++) {                                 \
            if (ready_expr) { (misses) = 0; return SHMQ_OK; }                    \
            SHMQ_CPU_RELAX();                                                    \
            if ((spin_i_ & 63) == 0 && shmq_now_ns() > spin_end_) break;         \
        }                                                                        \
        (misses)++;                                                              \
    } while (0)

/* After a sleep: a wait shorter than the spin window means spinning would
 * have paid off, so the next wait spins again. */
static inline void shmq_note_sleep(uint32_t *misses, uint64_t slept_since) {
    if (shmq_now_ns() - slept_since < SHMQ_SPIN_NS) *misses = 0;
}


static inline int shmq_readable(shmq_ring *r) {
    uint64_t head = __atomic_load_n(&r->hdr->head_pos, __ATOMIC_RELAXED);
    if (head != r->cached_tail) {
        if (!r->mpsc) return 1;
    } else {
        r->cached_tail = __atomic_load_n(&r->hdr->tail_pos, __ATOMIC_ACQUIRE);
        if (head == r->cached_tail) return 0;
        if (!r->mpsc) return 1;
    }
    uint32_t tag = __atomic_load_n(&r->avail[(head & r->mask) / SHMQ_RECORD_ALIGN], __ATOMIC_ACQUIRE);
    return tag == shmq_lap_tag(r, head);
}

/* Wait up to timeout_ns for a published record at head.  Returns SHMQ_OK
 * when one may be there, SHMQ_TIMEOUT when the slice ended.  Call without
 * holding the GIL. */
static inline int shmq_wait_readable(shmq_ring *r, uint64_t timeout_ns) {
    shmq_header *h = r->hdr;
    if (r->read_spin_misses < SHMQ_SPIN_MAX_MISSES)
        SHMQ_SPIN_UNTIL(shmq_readable(r), r->read_spin_misses);
    uint32_t seq = __atomic_load_n(&h->data_seq, __ATOMIC_ACQUIRE);
    __atomic_store_n(&h->consumer_waiting, 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int ready = shmq_readable(r);
    if (!ready) {
        uint64_t t0 = shmq_now_ns();
        shmq_word_wait(&h->data_seq, seq, timeout_ns);
        shmq_note_sleep(&r->read_spin_misses, t0);
    }
    __atomic_store_n(&h->consumer_waiting, 0, __ATOMIC_RELAXED);
    return (ready || shmq_readable(r)) ? SHMQ_OK : SHMQ_TIMEOUT;
}

/* Room for need bytes, or the positions are corrupt (stop waiting: the
 * claim that follows reports it). */
static inline int shmq_writable(shmq_ring *r, uint64_t need) {
    uint64_t t = __atomic_load_n(&r->hdr->tail_pos, __ATOMIC_RELAXED);
    return shmq_has_space(r, &t, need) != SHMQ_FULL;
}

/* Wait up to timeout_ns for `need` free bytes.  Call without the GIL. */
/* Wait up to timeout_ns for `need` free bytes.  Call without the GIL.
 * Only the first waiter spins (see SHMQ_SPIN_NS). */
static inline int shmq_wait_writable(shmq_ring *r, uint64_t need, uint64_t timeout_ns) {
    shmq_header *h = r->hdr;
    if (__atomic_load_n(&h->space_wanted, __ATOMIC_RELAXED) == 0 &&
        r->write_spin_misses < SHMQ_SPIN_MAX_MISSES)
        SHMQ_SPIN_UNTIL(shmq_writable(r, need), r->write_spin_misses);
    else if (shmq_writable(r, need))
        return SHMQ_OK;
    uint32_t seq = __atomic_load_n(&h->space_seq, __ATOMIC_ACQUIRE);
    /* Announce the need (atomic max), then re-check: see "Waiting". */
    uint64_t cur = __atomic_load_n(&h->space_wanted, __ATOMIC_RELAXED);
    while (cur < need && !__atomic_compare_exchange_n(&h->space_wanted, &cur, need, 1,
                                                      __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
        ;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (shmq_writable(r, need)) return SHMQ_OK;
    uint64_t t0 = shmq_now_ns();
    shmq_word_wait(&h->space_seq, seq, timeout_ns);
    shmq_note_sleep(&r->write_spin_misses, t0);
    return shmq_writable(r, need) ? SHMQ_OK : SHMQ_TIMEOUT;
}

#endif /* SHMQ_RING_H */
