"""The training process: ShmLoader, its session of processes, the runs it reads, its epochs."""
