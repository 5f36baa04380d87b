"""Prints the include directory holding xla/ffi/api/ffi.h for the build.

XLA rejects a handler compiled against newer FFI headers than the jaxlib that runs it, so the
headers must come from the jaxlib the extension will run with. Under pip's build isolation the
build environment may hold a newer jaxlib than the target environment: prefer the target's
(its site-packages is still sysconfig's purelib inside the isolated build), then the build
environment's own.
"""
import importlib.util
import os
import sys
import sysconfig


def candidates():
    for key in ("purelib", "platlib"):
        yield os.path.join(sysconfig.get_paths()[key], "jaxlib", "include")
    spec = importlib.util.find_spec("jaxlib")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            yield os.path.join(location, "include")


for path in candidates():
    if os.path.isfile(os.path.join(path, "xla", "ffi", "api", "ffi.h")):
        print(path)
        sys.exit(0)
sys.exit("jax_nvfp4: no jaxlib with XLA FFI headers found; install jax first")
