"""The numerics header's branch-free e2m1 rounding against the comparison table of
docs/format.md §2 step 6 on every float32: on the CPU build, and on the GPU build where there
is one."""

import pytest

from jax_nvfp4 import _ffi


def test_e2m1_rounding_matches_ladder_on_every_float_cpu():
    assert _ffi._e2m1_code_mismatches() == 0


@pytest.mark.gpu
def test_e2m1_rounding_matches_ladder_on_every_float_gpu():
    if not _ffi.built_with_cuda():
        pytest.fail("a GPU is visible but jax_nvfp4 was built without its CUDA kernel")
    assert _ffi._e2m1_code_mismatches_cuda() == 0
