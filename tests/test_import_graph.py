"""The modules of ``jax_nvfp4/`` import each other without a cycle.

Every ``from . import x``, ``from .x import y`` and ``import jax_nvfp4.x`` is read with ``ast``,
including the imports inside functions (a lazy import hides a cycle, it does not remove it).
The layers, each importing only from those above it:

1. ``layout`` (cache geometry, constants), ``_ffi`` (the compiled extension)
2. ``checks`` (trace-time validation)
3. ``reference`` (pure jnp: store, reader, attention), ``partitioning`` (rules under a
   multi-device jit)
4. ``primitive`` (the store primitive)
5. ``api`` (public store, allocator, reader), ``attention_primitive`` (the decode primitive),
   ``outliers`` (the calibration report and the head-dimension rotation)
6. ``ragged_primitive`` (the ragged-attention primitive; uses the decode primitive's split plan)
7. ``attention`` (public decode and ragged attention), ``testing`` (assertions for tests)
8. ``sharding`` (tensor-parallel API: the head-grouped cache)
9. ``__init__``
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_nvfp4"
NAME = "jax_nvfp4"

LAYERS = [
    {"layout", "_ffi"},
    {"checks"},
    {"reference", "partitioning"},
    {"primitive"},
    {"api", "attention_primitive", "outliers"},
    {"ragged_primitive"},
    {"attention", "testing"},
    {"sharding"},
    {"__init__"},
]


def _modules():
    names = {p.stem for p in PACKAGE.glob("*.py")}
    # The compiled extension has no .py source; it imports nothing of the package.
    return names | {"_ffi"}


def imports_of(path, modules):
    """Package modules that the file at ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:          # from . import x, y
                found.update(a.name for a in node.names)
            elif node.level == 1:                                  # from .x import y
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.split(".")[0] == NAME:
                parts = node.module.split(".")                     # from jax_nvfp4.x import y
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
            elif node.level > 1:
                raise AssertionError(f"{path.name}: relative import above the package")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == NAME and len(parts) > 1:            # import jax_nvfp4.x
                    found.add(parts[1])
    return {m for m in found if m in modules}


def import_graph():
    modules = _modules()
    return {p.stem: imports_of(p, modules) for p in sorted(PACKAGE.glob("*.py"))} | {"_ffi": set()}


def find_cycle(graph):
    """A list of modules forming a cycle, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_reader_sees_every_import_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from . import a, b as c\nfrom .d import e\nimport jax_nvfp4.f\n"
                      "from jax_nvfp4 import g\nfrom jax_nvfp4.h import i\nimport jax\n"
                      "def lazy():\n    from . import j\n")
    assert imports_of(source, set("abcdefghij")) == set("abdfghj")


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert find_cycle(graph) is None, find_cycle(graph)


def test_modules_import_only_from_layers_above():
    """Every module is in ``LAYERS`` and imports only modules of earlier layers."""
    graph = import_graph()
    layer = {m: i for i, names in enumerate(LAYERS) for m in names}
    assert set(graph) == set(layer), "add new modules to LAYERS (and the docstring)"
    wrong = {(m, d) for m, deps in graph.items() for d in deps if layer[d] >= layer[m]}
    assert not wrong, wrong


def test_sharding_keeps_its_public_names():
    """Splitting the partitioning rules out of ``sharding`` kept every public name there."""
    from jax_nvfp4 import partitioning, sharding

    for name in ("SPLITTABLE", "partitioned_store", "grouped_kv_cache_shape", "split_heads",
                 "merge_heads", "reshape_and_cache_grouped", "dequantize_grouped",
                 "layer_slots", "layer_block_tables", "paged_attention_grouped"):
        assert callable(getattr(sharding, name)) or name == "SPLITTABLE", name
    assert sharding.partitioned_store is partitioning.partitioned_store
    assert sharding.SPLITTABLE == partitioning.SPLITTABLE == ("layer", "blocks")
