"""Packages of pyproject's test extra that some Python versions cannot
install: the extra leaves them out there (an environment marker), and only
there may their tests skip.  Anywhere else a missing package is an error of
the environment, not a reason to skip, so it is imported as usual."""

import importlib
import sys

import pytest

# package -> (the requirement in the test extra, the oldest Python it has a release for)
NEEDS_NEWER_PYTHON = {
    "transformers": ("transformers>=5.24", (3, 11)),
    "obstore": ("obstore>=0.12", (3, 11)),
    "jax": ("jax[cpu]>=0.10", (3, 11)),
}


def import_or_skip_on_older_python(name: str):
    """The module `name`; a skip, saying why, where no release of it
    installs on this Python."""
    requirement, oldest = NEEDS_NEWER_PYTHON[name]
    if sys.version_info < oldest:
        running = ".".join(map(str, sys.version_info[:2]))
        pytest.skip(f"{requirement} has no release for Python {running} (it needs "
                    f"{'.'.join(map(str, oldest))}+), so the test extra leaves it out here",
                    allow_module_level=True)
    return importlib.import_module(name)
