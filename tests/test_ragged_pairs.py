"""The pipelined prefill kernel's pairs of CTAs (ragged v21, ffi/ragged_pipelined.cu: two CTAs of a
cluster share the converted K/V stages, each converting half of every step) give the bytes that
each CTA alone gives: the same ragged calls in this process (pairs, the default) and in a
process with ``JAX_NVFP4_RAGGED_PAIRS=0`` (the switch is read once per process), output and lse
compared bit for bit, and against the jnp path within the kernel's bounds. The cases have
sequences of many tiles with even and odd counts of tile pairs (the second CTA of a cluster
without tiles), pages of 12, 16 and 20 positions (a step's two ring steps over page edges),
both layouts and V-scale orders, a split-KV plan, and a float32 query.

Run as a script (``python -P tests/test_ragged_pairs.py OUT.npz``) it writes the kernel's
results of every case to OUT.npz: the test's other process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ragged_cases import ragged_jit, shared_case  # noqa: E402

# (seed, seqs (kv_len, q_len), layout, swizzle, block_size, q dtype); 2 kv heads, 8 q heads
# (64-row tiles of 16 tokens, a pair 32 tokens, a cluster's unit 64).
CASES = (
    (61, ((900, 300), (500, 100), (2000, 150), (70, 70)), "HND", True, 16, "bfloat16"),
    (62, ((640, 128), (333, 97), (129, 130)), "NHD", False, 12, "float16"),
    (63, ((5000, 40), (1200, 260)), "HND", False, 20, "float32"),
    (64, ((6000, 96),), "NHD", True, 16, "bfloat16"),               # split-KV over 6000
)


def _case(index):
    seed, seqs, layout, swizzle, block_size, dtype = CASES[index]
    case = shared_case(seed, seqs, head_size=128, layout=layout, v_scale_swizzle=swizzle,
                       block_size=block_size, num_kv_heads=2, pad_tokens=3)
    with jax.default_device(jax.devices("cpu")[0]):
        q = case.query(8, jnp.dtype(dtype), seed=seed)
    return case, q


def _kernel_results():
    gpu = jax.devices("gpu")[0]
    results = {}
    for i in range(len(CASES)):
        case, q = _case(i)
        out, lse = ragged_jit(*jax.device_put(case.args(q), gpu), **case.options,
                              return_lse=True, impl="kernel")
        out, lse = jax.device_get((out, lse))
        results[f"out{i}"] = np.asarray(out).view(np.uint8)
        results[f"lse{i}"] = np.asarray(lse).view(np.uint8)
    return results


@pytest.mark.gpu
def test_gpu_pairs_give_the_bytes_of_ctas_alone(tmp_path):
    from test_ragged_attention import assert_kernel_matches_jnp
    from jax_nvfp4 import ragged_primitive as rp

    case, _ = _case(3)
    assert rp.plan_splits(1, case.num_tokens, len(case.tables), 2, 8, 128, case.capacity, 132,
                          2)[0] > 1, "case 64 is to split"
    paired = _kernel_results()
    alone_file = tmp_path / "alone.npz"
    env = dict(os.environ, JAX_NVFP4_RAGGED_PAIRS="0")
    done = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), str(alone_file)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    alone = np.load(alone_file)
    assert sorted(alone.files) == sorted(paired)
    for name in paired:
        np.testing.assert_array_equal(paired[name], alone[name], err_msg=name)
    for i in range(len(CASES)):
        case, q = _case(i)
        assert_kernel_matches_jnp(case, q, f"pairs{CASES[i][0]}")


if __name__ == "__main__":
    np.savez(sys.argv[1], **_kernel_results())
