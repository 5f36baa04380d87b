"""The numerics header's branch-free e2m1 rounding against the comparison table of
docs/format.md §2 step 6 on every float32, and each code's value read off the rounding's bits
(4over6's error) against the table's: on the CPU build, and on the GPU build where there is one;
on the GPU also the hardware's e4m3 conversions (what the store uses: NVFP4_HW_E4M3, on by
default) against the software's, every float encoded and every byte decoded, and the attention
kernels' E2M1 -> fp16 conversion of the cache's codes against the spec's values, every 32-bit
word of eight codes."""

import os

import pytest

from jax_nvfp4 import _ffi


def test_e2m1_rounding_matches_ladder_on_every_float_cpu():
    assert _ffi._e2m1_code_mismatches() == 0


@pytest.mark.gpu
def test_e2m1_rounding_matches_ladder_on_every_float_gpu():
    _skip_under_sanitizer_or_fail_without_cuda()
    assert _ffi._e2m1_code_mismatches_cuda() == 0


@pytest.mark.gpu
def test_e4m3_conversions_match_software_on_every_float_gpu():
    _skip_under_sanitizer_or_fail_without_cuda()
    assert _ffi._e4m3_mismatches_cuda() == 0


@pytest.mark.gpu
def test_e2m1_to_f16_conversion_matches_spec_on_every_code_word_gpu():
    _skip_under_sanitizer_or_fail_without_cuda()
    assert _ffi._e2m1_to_f16_mismatches_cuda() == 0


def _skip_under_sanitizer_or_fail_without_cuda():
    """Under compute-sanitizer (tests/gpu_checks.sh sets JAX_NVFP4_SANITIZER to the tool) the
    2^32 iterations are not run: the kernel takes no count (a smaller range would need a kernel
    argument), its only memory access is one atomicAdd per thread, and the full check runs
    unsanitized in the script's suite-gpu part."""
    tool = os.environ.get("JAX_NVFP4_SANITIZER")
    if tool:
        pytest.skip(f"under compute-sanitizer {tool}: the 2^32-input self-check runs unsanitized")
    if not _ffi.built_with_cuda():
        pytest.fail("a GPU is visible but jax_nvfp4 was built without its CUDA kernel")
