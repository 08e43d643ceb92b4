"""Which indices a run loads, in which order, and what a state records of it."""
