"""The worker processes (or threads): claim units of a run, load them, write their rows."""
