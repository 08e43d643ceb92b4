# Included by _native.pyx: the loader's own shuffle, a seeded bijection of
# [0, n) computed per position (see NOTE [ The seeded order ] in order/indices.py).
#
# Why compiled: every worker computes the dataset index of each position it
# claims, and main computes whole chunks of them (a resumed epoch, an error
# message, an inline epoch); the order is never written out, so its cost
# per index is the loader's cost per sample at any dataset size.  One
# index is ~a dozen multiply/xor-shift steps: tens of nanoseconds in C,
# microseconds in Python.

from libc.stdint cimport int64_t

cdef enum:
    # Feistel rounds: 4 already make a pseudo-random permutation of a
    # pseudo-random round function (Luby-Rackoff); 2 more are margin
    ROUNDS = 6

cdef inline uint64_t _mix64(uint64_t z) noexcept nogil:
    # splitmix64's finaliser: every input bit flips each output bit with
    # probability ~1/2, so a round's output looks independent of its input
    z = (z ^ (z >> 30)) * <uint64_t>0xbf58476d1ce4e5b9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94d049bb133111ebULL
    return z ^ (z >> 31)


cdef struct _Feistel:
    uint64_t n            # the permutation is of [0, n)
    int bits              # the network works on [0, 2**bits), the least >= n (bits >= 2)
    bint shuffled         # False: the identity (an unshuffled order shares this code)
    uint64_t keys[ROUNDS]


cdef inline uint64_t _encrypt(const _Feistel *f, uint64_t x) noexcept nogil:
    """One pass of the network over [0, 2**bits).  The word is cut into a
    high part of `hi` bits and a low part of `lo` bits (unequal when bits
    is odd); a round mixes the low part into the high one, then rotates
    the low part to the top, so the two parts swap roles and sizes each
    round.  Each round is a bijection: the low part it keeps undoes it."""
    cdef int lo = f.bits >> 1
    cdef int hi = f.bits - lo
    cdef int r, t
    cdef uint64_t low, high
    for r in range(ROUNDS):
        low = x & ((<uint64_t>1 << lo) - 1)
        high = (x >> lo) ^ (_mix64(low ^ f.keys[r]) & ((<uint64_t>1 << hi) - 1))
        x = (low << hi) | high
        t = lo
        lo = hi
        hi = t
    return x


cdef inline uint64_t _permute(const _Feistel *f, uint64_t q) noexcept nogil:
    """The index at position q < n: the network's image of q, walked
    again while it falls in [n, 2**bits) (cycle-walking: the cycle of q
    under the network comes back to [0, n), so this ends; 2**bits < 2n
    makes it about 2 passes on average)."""
    if not f.shuffled:
        return q
    q = _encrypt(f, q)
    while q >= f.n:
        q = _encrypt(f, q)
    return q


cdef class SeededOrder:
    """This rank's order of an epoch: position p is full position
    q = rank + p * world of the epoch's order over n indices, wrapped round
    (q mod n: torch's DistributedSampler pads the order with its start so
    every rank gets as many), and its index is the seeded permutation of q
    (or q itself, unshuffled).  Nothing of size n is ever held.

    at(p) for one position; fill() and take() for many at C speed."""

    cdef _Feistel f
    cdef readonly uint64_t n
    cdef readonly uint64_t seed, epoch
    cdef readonly bint shuffled
    cdef readonly int64_t rank, world

    def __init__(self, uint64_t n, uint64_t seed, uint64_t epoch, bint shuffled,
                 int64_t rank=0, int64_t world=1):
        if n >= (<uint64_t>1 << 62):
            raise ValueError(f"an order of {n} indices: the loader's order holds up to 2**62")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need 0 <= rank < world")
        self.n, self.seed, self.epoch, self.shuffled = n, seed, epoch, shuffled
        self.rank, self.world = rank, world
        self.f.n = n
        self.f.shuffled = shuffled
        cdef int bits = 2
        while bits < 64 and (<uint64_t>1 << bits) < n:
            bits += 1
        self.f.bits = bits
        # round keys: a splitmix64 stream started from (seed, epoch), so
        # every (seed, epoch) pair has its own network
        cdef uint64_t state = _mix64(seed ^ <uint64_t>0x6a09e667f3bcc909ULL) ^ \
            _mix64(epoch + <uint64_t>0x3c6ef372fe94f82bULL)
        cdef int r
        for r in range(ROUNDS):
            state += <uint64_t>0x9e3779b97f4a7c15ULL
            self.f.keys[r] = _mix64(state)

    def __reduce__(self):
        return SeededOrder, (self.n, self.seed, self.epoch, self.shuffled, self.rank, self.world)

    cdef inline int64_t _at(self, uint64_t p) noexcept nogil:
        cdef uint64_t q = <uint64_t>self.rank + p * <uint64_t>self.world
        if q >= self.n:
            q %= self.n
        return <int64_t>_permute(&self.f, q)

    cpdef int64_t at(self, int64_t pos) except? -1:
        """The dataset index at position pos of this rank's order."""
        if pos < 0 or self.n == 0:
            raise IndexError(f"position {pos} of an order of {self.n} indices")
        return self._at(<uint64_t>pos)

    def fill(self, int64_t[::1] out not None, int64_t first):
        """out[j] = at(first + j)."""
        if first < 0 or (self.n == 0 and out.shape[0]):
            raise IndexError(f"positions from {first} of an order of {self.n} indices")
        cdef Py_ssize_t j
        with nogil:
            for j in range(out.shape[0]):
                out[j] = self._at(<uint64_t>(first + j))

    def take(self, int64_t[::1] out not None, const int64_t[::1] positions not None):
        """out[j] = at(positions[j])."""
        if out.shape[0] != positions.shape[0]:
            raise ValueError(f"{out.shape[0]} outputs for {positions.shape[0]} positions")
        cdef Py_ssize_t j
        cdef bint bad = False
        with nogil:
            for j in range(out.shape[0]):
                if positions[j] < 0:
                    bad = True
                    break
                out[j] = self._at(<uint64_t>positions[j])
        if bad or (self.n == 0 and out.shape[0]):
            raise IndexError(f"a negative position, or an order of no indices ({self.n})")
