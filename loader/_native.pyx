# The loader's compiled pieces: what must run as C (a signal handler that
# works while the process is inside any C call) or per sample.
#
# Compiler directives are set in setup.py.

cdef extern from *:
    """
    #include <signal.h>
    #include <string.h>
    #include <sys/prctl.h>
    #include <unistd.h>

    static volatile pid_t loader_parent_pid = 0;

    /* PR_SET_PDEATHSIG fires when the *thread* that forked this process
     * exits, and again each time the child is re-parented.  Only a parent
     * process that is really gone (getppid() changed: re-parented to init
     * or a subreaper) ends the child.  getppid and _exit are
     * async-signal-safe. */
    static void loader_on_parent_death(int sig) {
        (void)sig;
        if (getppid() != loader_parent_pid) _exit(1);
    }

    static int loader_die_with_parent(pid_t parent, int sig) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = loader_on_parent_death;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        loader_parent_pid = parent;
        if (sigaction(sig, &sa, NULL) != 0) return -1;
        if (prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0) return -1;
        if (getppid() != parent) _exit(1);  /* it died before prctl took effect */
        return 0;
    }
    """
    int loader_die_with_parent(int parent, int sig) nogil

from libc.errno cimport errno
import os


def die_with_parent(int parent_pid, int sig):
    """End this process at once when parent_pid, its parent process, dies
    (not when the parent's thread that forked it ends): see the C above."""
    if loader_die_with_parent(parent_pid, sig) != 0:
        raise OSError(errno, f"cannot ask to die with the parent process: {os.strerror(errno)}")
