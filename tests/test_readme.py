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
import pytest

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


BLOCKS = python_blocks(README.read_text())


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
