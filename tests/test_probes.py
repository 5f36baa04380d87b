"""The standalone probes of benchmarks/ (``*.cu``, each run by hand on a GPU: its header says
how) still compile against ffi/'s headers, where nvcc is on PATH (CI has it). They include the
kernels' headers, so a change there can break them, and nothing else builds them."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sass_counts  # noqa: E402  (benchmarks/: where the XLA FFI headers are)

PROBES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.cu")))


def test_the_probes_are_found():
    assert "chain_probe.cu" in PROBES and "wgmma_probe.cu" in PROBES, PROBES


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")
@pytest.mark.parametrize("probe", PROBES)
def test_probe_compiles(probe, tmp_path):
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O2", "-c",
           f"-I{os.path.join(ROOT, 'ffi')}", f"-I{sass_counts.ffi_include()}",
           "-o", str(tmp_path / "probe.o"), os.path.join(ROOT, "benchmarks", probe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
