"""The standalone probes of benchmarks/ (``*.cu``, each run by hand on a GPU: its header says
how) still compile against ffi/'s headers, where nvcc is on PATH (CI has it). They include the
kernels' headers, so a change there can break them, and nothing else builds them."""

from __future__ import annotations

import glob
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sass_counts  # noqa: E402  (benchmarks/: the one nvcc command line of the CPU tests)

PROBES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.cu")))


def test_the_probes_are_found():
    assert "chain_probe.cu" in PROBES and "wgmma_probe.cu" in PROBES, PROBES


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
@pytest.mark.parametrize("probe", PROBES)
def test_probe_compiles(probe):
    """Its device code, compiled as sass_counts compiles ffi/ (the build's flags, the XLA FFI
    headers, sm_90a): nvcc failing raises, and ptxas's log names the probe's kernels."""
    log = sass_counts.ptxas_log(ROOT, os.path.join("benchmarks", probe))
    assert "Compiling entry function" in log, log[-2000:]
