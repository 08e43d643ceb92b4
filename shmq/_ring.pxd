# Declarations of shmq_ring.h for Cython.  MUST MATCH shmq_ring.h, which is
# the authority for the layout; tests/shmq_layer/test_layout.py compares the two.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uint8_t


cdef extern from "shmq_ring.h" nogil:
    uint64_t SHMQ_MAGIC
    uint32_t SHMQ_VERSION
    uint32_t SHMQ_CACHELINE
    uint32_t SHMQ_RECORD_ALIGN
    uint32_t SHMQ_PAGE
    uint64_t SHMQ_MIN_CAPACITY
    uint64_t SHMQ_MAX_CAPACITY
    uint32_t SHMQ_MAX_ATTACH
    uint32_t SHMQ_MAX_NDIM
    uint32_t SHMQ_MAX_DTYPE_CHARS

    uint32_t SHMQ_FLAG_MPSC

    uint32_t SHMQ_KIND_ARRAY
    uint32_t SHMQ_KIND_TREE
    uint32_t SHMQ_KIND_SKIP

    uint32_t SHMQ_SLOT_FREE
    uint32_t SHMQ_SLOT_OPEN
    uint32_t SHMQ_SLOT_CLOSED
    uint32_t SHMQ_SLOT_GONE
    uint32_t SHMQ_SLOT_STATE_MASK
    uint32_t SHMQ_SLOT_PRODUCED
    uint32_t SHMQ_SLOT_CONSUMER
    uint32_t SHMQ_SLOT_PENDING

    int SHMQ_OK
    int SHMQ_EMPTY
    int SHMQ_FULL
    int SHMQ_PENDING
    int SHMQ_TIMEOUT
    int SHMQ_CORRUPT
    int SHMQ_NO_SLOT
    int SHMQ_ABANDONED
    int SHMQ_AMBIGUOUS
    int64_t SHMQ_ROLE_CORRUPT
    uint64_t SHMQ_CLAIM_OWNED

    int SHMQ_PEERS_OPEN
    int SHMQ_PEERS_CLOSED
    int SHMQ_PEERS_LOST

    int SHMQ_FIELD_NONE
    int SHMQ_FIELD_MAGIC
    int SHMQ_FIELD_VERSION
    int SHMQ_FIELD_FLAGS
    int SHMQ_FIELD_CAPACITY
    int SHMQ_FIELD_OFFSETS
    int SHMQ_FIELD_FILE_SIZE
    int SHMQ_FIELD_POSITIONS
    int SHMQ_FIELD_RECORD_BYTES
    int SHMQ_FIELD_MAX_ATTACH
    int SHMQ_FIELD_ROLE_SLOT
    int SHMQ_FIELD_CONSUMER_SLOT
    int SHMQ_FIELD_PRODUCER_SLOT
    int SHMQ_FIELD_CLAIM

    ctypedef struct shmq_slot:
        uint64_t owner
        uint64_t starttime
        uint64_t claim_pos
        uint64_t claim_bytes
        uint64_t pending_since_ns

    ctypedef struct shmq_header:
        uint64_t magic
        uint32_t version
        uint32_t flags
        uint64_t capacity_bytes
        uint64_t data_offset
        uint64_t slots_offset
        uint64_t avail_offset
        uint32_t max_attach
        uint32_t creator_pid
        uint64_t creator_starttime
        uint64_t tail_pos
        uint64_t head_pos
        uint32_t data_seq
        uint32_t consumer_waiting
        uint32_t space_seq
        uint64_t space_wanted
        int32_t consumer_slot
        int32_t producer_slot
        uint32_t closed_writers
        uint32_t gone_writers
        uint32_t skipped_records
        uint64_t creator_pidns

    ctypedef struct shmq_record:
        uint64_t record_bytes
        uint32_t kind
        uint32_t nbuffers
        uint64_t meta_bytes
        uint32_t producer_pid
        uint32_t reserved

    ctypedef struct shmq_array_meta:
        uint32_t ndim
        uint32_t dtype_chars
        uint64_t data_offset
        uint64_t data_bytes

    ctypedef struct shmq_tree_meta:
        uint64_t pickle_offset
        uint64_t pickle_bytes

    ctypedef struct shmq_buffer_entry:
        uint64_t offset
        uint64_t nbytes

    ctypedef struct shmq_ring:
        shmq_header *hdr
        shmq_slot *slots
        uint32_t *avail
        uint8_t *data
        uint64_t capacity
        uint64_t mask
        unsigned cap_shift
        int mpsc
        int32_t slot
        uint64_t cached_head
        uint64_t cached_tail
        uint32_t read_spin_misses
        uint32_t write_spin_misses
        int bad_field
        uint64_t bad_value
        uint64_t bad_limit

    uint64_t shmq_align_up(uint64_t x, uint64_t a)
    void shmq_layout(uint64_t capacity, int mpsc, uint32_t max_attach,
                     uint64_t *slots_offset, uint64_t *avail_offset, uint64_t *data_offset)
    uint64_t SHMQ_STARTTIME_UNKNOWN
    uint64_t shmq_proc_starttime(uint32_t pid)
    int shmq_owner_alive(const shmq_slot *s, uint64_t owner)
    void shmq_init(void *base, uint64_t capacity, int mpsc, uint32_t creator_pid,
                   uint64_t creator_starttime, uint64_t creator_pidns)
    uint64_t shmq_self_pidns()
    int shmq_validate(const void *base, uint64_t file_bytes, int live, int *bad_field)
    void shmq_bind(shmq_ring *r, void *base, uint64_t capacity, int mpsc)
    int shmq_positions_ok(uint64_t capacity, uint64_t head, uint64_t tail)
    uint8_t *shmq_at(const shmq_ring *r, uint64_t pos)

    int32_t shmq_slot_acquire(shmq_ring *r, uint32_t pid, uint64_t starttime, uint32_t flags)
    int shmq_slot_update(shmq_ring *r, int32_t i, uint64_t expect, uint64_t desired)
    uint64_t shmq_slot_owner(const shmq_ring *r, int32_t i)
    void shmq_slot_close(shmq_ring *r, int32_t i)
    int shmq_writers_status(shmq_ring *r)
    int shmq_reader_status(shmq_ring *r)
    int64_t shmq_take_role(shmq_ring *r, int32_t *role_slot, int32_t i, uint64_t flag,
                           int replace_closed)

    int shmq_claim(shmq_ring *r, uint64_t need, uint64_t *pos)
    void shmq_publish(shmq_ring *r, uint64_t pos, uint64_t need)
    int shmq_peek(shmq_ring *r, uint64_t *pos, uint64_t *nbytes)
    void shmq_release(shmq_ring *r, uint64_t pos, uint64_t nbytes)
    int shmq_resolve_pending(shmq_ring *r, uint64_t head, uint64_t *skip_bytes, uint32_t *dead_pid)
    int shmq_wait_readable(shmq_ring *r, uint64_t timeout_ns)
    int shmq_wait_writable(shmq_ring *r, uint64_t need, uint64_t timeout_ns)
