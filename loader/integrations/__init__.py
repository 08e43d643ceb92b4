"""Integrations of the loaders with training frameworks that rebuild or
wrap data loaders (see each module)."""


class LoaderReplacedWarning(UserWarning):
    """A framework rebuilt a loader.DataLoader as another class: its batches
    do not come from ShmLoader's workers."""
