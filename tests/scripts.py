"""The repository's scripts (examples/, benchmarks/) loaded as modules by the tests."""

import importlib.util
import pathlib
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
