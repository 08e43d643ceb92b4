# Included by _core.pyx: the registry of this process's open queue handles
# and the fork hooks that keep every handle counted across fork().
#
# Why compiled: Python runs os.register_at_fork hooks and swallows any
# exception they raise ("Exception ignored in ...").  A Ctrl-C whose handler
# ran inside a hook written in Python (at any bytecode boundary) would be
# lost.  Code here runs no Python bytecode and never checks signals, so a
# pending KeyboardInterrupt is raised after fork() returns instead.
# (The weakref callback below is compiled for the same reason.)

import weakref

cdef dict _handles = {}   # weakref to each open shmq.Queue of this process -> None


def _forget_dead(ref):
    _handles.pop(ref, None)


def register_handle(q):
    _handles[weakref.ref(q, _forget_dead)] = None


def forget_handle(q):
    _handles.pop(weakref.ref(q), None)  # live weakrefs compare by referent


def open_handles():
    """The live shmq.Queue objects registered in this process."""
    return [q for q in [ref() for ref in list(_handles)] if q is not None]


def before_fork():
    for q in open_handles():
        (<Ring>q._ring).reserve_child_slot()


def after_fork_in_parent():
    for q in open_handles():
        (<Ring>q._ring).forget_child_slot()


def after_fork_in_child():
    for q in open_handles():
        (<Ring>q._ring).adopt_child_slot(q._pid)  # q._pid is still the parent's here
        q._pid = os.getpid()
        q._creator_pid = None  # the child never unlinks its parent's names
