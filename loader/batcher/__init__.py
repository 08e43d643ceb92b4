"""The batcher process: lays batches out in slabs of the pool and tells main when each is complete."""
