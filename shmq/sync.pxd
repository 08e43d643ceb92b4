# Cython declarations of shmq_sync.h (waiting and waking on shared 32-bit
# words).  MUST MATCH shmq_sync.h.  Other Cython modules (the loader's) use
# them without the GIL:
#
#     from shmq.sync cimport shmq_word_wait, shmq_word_wake
#
# (built with shmq's directory on the include path, as setup.py does).
# It declares C only, so a cimport of it imports nothing at run time;
# sync.py, of the same name, is the Python face of the same primitives.
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "shmq_sync.h" nogil:
    int SHMQ_WAKE_ALL
    int shmq_word_wait(uint32_t *word, uint32_t expect, uint64_t timeout_ns)
    int shmq_word_wake(uint32_t *word, int n)
