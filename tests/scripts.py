"""The repository's scripts (examples/, benchmarks/) loaded as modules by the tests, or run as
commands on the CPU."""

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(relative_path, module_name):
    """``ROOT / relative_path`` executed as module ``module_name`` (registered in sys.modules,
    which dataclasses need); a distinct name gives a distinct module object."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_on_cpu(relative_path, *args, time_limit_s):
    """Runs ``python ROOT/relative_path args...`` from the repository root in its own process on
    JAX's CPU backend (``JAX_PLATFORMS=cpu``), killed past ``time_limit_s`` (a hang fails);
    asserts exit status 0 (the output's tail in the message) and returns the CompletedProcess
    (text stdout and stderr)."""
    done = subprocess.run([sys.executable, str(ROOT / relative_path), *map(str, args)], cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=time_limit_s,
                          capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done
