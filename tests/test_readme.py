"""Every ```python block of README.md runs as written, on the CPU.

Blocks run one by one, each in a fresh namespace (a reader copies one block at a time), on the
CPU devices (tests/conftest.py makes the CPU the default device and provides 8 of them), so a
block that would take the fused CUDA kernel on a GPU runs the jnp path here. A block whose first
line is ``# Needs N devices ...`` builds its own mesh of ``jax.devices()[:N]``: it runs when JAX
has at least N default devices (the 8 virtual CPU devices here) and is skipped otherwise (e.g.
on a machine with a single GPU). Blocks in other languages (``bash``) are not run.
"""

import contextlib
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_NEEDS = re.compile(r"#\s*Needs (\d+) devices")


def python_blocks(text):
    """(line number, source) of every ```python block, indented ones (in lists) included."""
    blocks = []
    for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
        indent = len(m.group(1))
        source = "\n".join(line[indent:] for line in m.group(2).splitlines())
        blocks.append((text[:m.start()].count("\n") + 1, source))
    return blocks


TEXT = README.read_text()
BLOCKS = python_blocks(TEXT)


def block_under(heading):
    """The first python block after ``heading`` (a line of README.md)."""
    start = TEXT.splitlines().index(heading) + 1
    return next(source for line, source in BLOCKS if line > start)


def run_block(source, name):
    namespace = {"__name__": name}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, f"README.md:{name}", "exec"), namespace)
    return namespace


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2
    assert any(_NEEDS.match(src) for _, src in BLOCKS)


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_block_runs(line, source):
    needs = _NEEDS.match(source)
    if needs and len(jax.devices()) < int(needs.group(1)):
        pytest.skip(f"README block at line {line} needs {needs.group(1)} devices, "
                    f"{len(jax.devices())} available")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})
    print(out.getvalue())


def test_readme_multi_layer_decode_step(monkeypatch):
    """The README's decode step over several layers does what its text says: the tuple of
    caches is donated (updated in place), seq_lens counts the token each step stores (every
    position below it is stored in every layer, none past it), and the kernel's caches are
    those of the jnp reference run through the same program, byte for byte."""
    source = block_under("### A decode step over several layers")
    ns = run_block(source, "multi_layer")
    assert ns["first"].is_deleted()
    geo = jax_nvfp4.layout.CacheGeometry.from_shape(ns["caches"][0].shape, "HND")
    tables, lens = ns["block_tables"], ns["seq_lens"]
    assert len(ns["caches"]) == ns["num_layers"] and (lens == ns["step"] + 1).all()
    for cache, (k_scale, v_scale) in zip(ns["caches"], np.asarray(ns["scales"])):
        k, _ = jax_nvfp4.dequantize(cache, k_scale, v_scale, dtype=jnp.float32)
        k = np.asarray(k).reshape(geo.num_slots, geo.num_kv_heads, geo.head_size)
        for b, n in enumerate(lens):
            pos = np.arange(tables.shape[1] * geo.block_size)
            rows = np.abs(k[tables[b, pos // geo.block_size] * geo.block_size
                            + pos % geo.block_size]).sum(axis=(1, 2))
            assert (rows[:n] > 0).all() and (rows[n:] == 0).all(), (b, n)
    monkeypatch.setattr(jax_nvfp4, "reshape_and_cache", jax_nvfp4.reference.reshape_and_cache)
    reference = run_block(source, "multi_layer_reference")
    for got, want in zip(ns["caches"], reference["caches"]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(ns["x"], np.float32),
                               np.asarray(reference["x"], np.float32), rtol=0.02, atol=0.02)


def test_readme_tensor_parallel_block_warns_on_too_few_devices(monkeypatch, capsys):
    """Run on one device (a CPU without the XLA flag), the tensor-parallel block still works
    but says so, naming the flag, rather than silently showing something else."""
    source = block_under("## Tensor parallelism (several devices)")
    one = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *backend: one)
    namespace = {"__name__": "tensor_parallel_one_device"}
    exec(compile(source, "README.md:tensor_parallel", "exec"), namespace)
    out = capsys.readouterr().out
    assert "warning: 1 device(s), not 4" in out and "xla_force_host_platform_device_count=4" in out
    assert namespace["out"].shape == (2, 32, 128)
    # With the devices it needs, no warning.
    monkeypatch.undo()
    if len(jax.devices()) >= 4:
        exec(compile(source, "README.md:tensor_parallel", "exec"), {"__name__": "tp"})
        assert "warning" not in capsys.readouterr().out


def test_readme_quickstart_says_what_error_to_expect(capsys):
    """examples/quickstart.py prints its read-back errors next to what to expect, and the
    README's figure is what it measures."""
    import importlib.util

    path = README.parent / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    quickstart.main()
    lines = capsys.readouterr().out.splitlines()
    expected = quickstart.EXPECTED_GAUSSIAN_ERROR
    assert f"about {expected} relative L2 for Gaussian data" in TEXT
    for name, line in zip(("key", "value"), lines):
        measured = float(re.match(rf"{name}: relative L2 error ([\d.]+) \(expected for Gaussian "
                                  rf"data: about {expected}\)", line).group(1))
        assert abs(measured - expected) < 0.002, line
