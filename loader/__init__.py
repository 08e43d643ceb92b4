"""ShmLoader: a zero-copy data loader built on shmq (not implemented yet;
see the project's issue tracker)."""

__all__: list[str] = []
