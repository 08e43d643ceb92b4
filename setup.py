"""Build of the compiled modules: shmq._core, and loader._native (the
loader's per-process C pieces, built on shmq's headers).

Compiler directives live here, in one place:
- language_level=3, embedsignature: ordinary Python 3 semantics and signatures
  in docstrings.
- boundscheck/wraparound stay ON module-wide; the hot functions in _core.pyx
  switch them off where a reader sees it.
Environment switches:
- SHMQ_DEBUG=1: -O0 -g, C asserts kept.
- SHMQ_SANITIZE=address|undefined|thread: build with that sanitizer (run the
  tests with LD_PRELOAD of the matching runtime).
"""

import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("SHMQ_DEBUG") == "1"
sanitize = os.environ.get("SHMQ_SANITIZE")

compile_args = ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
compile_args += ["-std=gnu11", "-Wall", "-Wno-unused-function"]
link_args = []
if sanitize:
    compile_args += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"]
    link_args += [f"-fsanitize={sanitize}"]

extensions = [
    Extension(
        "shmq._core",
        ["shmq/_core.pyx"],
        include_dirs=[np.get_include(), "shmq"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        depends=["shmq/shmq_ring.h", "shmq/shmq_sync.h", "shmq/_ring.pxd", "shmq/sync.pxd", "shmq/_fork.pxi",
                 "shmq/_sync.pxi"],
    ),
    Extension(
        "loader._native",
        ["loader/_native.pyx"],
        include_dirs=[np.get_include(), "shmq"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        depends=["shmq/shmq_sync.h", "shmq/sync.pxd", "loader/native/rowwriter.pxi", "loader/native/leases.pxi",
                 "loader/native/permutation.pxi"],
    ),
]

# The generated C depends on the interpreter and on the numpy it compiles
# against (the declarations numpy ships for Cython follow its C API), yet cythonize
# regenerates it only when a source is newer: one .c beside the .pyx, shared by
# every Python building in this tree, then no longer compiles for the next
# Python whose numpy is older.  So each (Python, numpy) pair gets its own.
generated_c_dir = os.path.join("build", "cython", f"{sys.implementation.cache_tag}-numpy{np.__version__}")

setup(
    ext_modules=cythonize(
        extensions,
        build_dir=generated_c_dir,
        compiler_directives={"language_level": "3", "embedsignature": True},
    ),
)
