"""The ragged-attention kernel's cases for compute-sanitizer (a script, not a pytest module): every
code path once and small (head sizes 64/128/256, both layouts, both V-scale orders, block sizes
8..32, GQA 1/4, tiles of 4 to 64 rows on mma.sync and wgmma, a split-KV plan with its merge, the
zero fill of unowned tokens, a sequence with more queries than cached tokens, one-token
sequences on the decode kernel, the few-row kernel alone under max_q_len with its fill and a
sequence over the bound, sequences of 17 to 32 rows on the pipelined kernel or the few-row
kernel's wgmma path, more pipelined units than SMs), each checked against the jnp path run on
the CPU (with the same bound: the same NaN rows). On a GPU machine, from the repository root
(TESTING.md has the environment the sanitizers need):

    compute-sanitizer --tool memcheck --kernel-name kns=nvfp4 python3 -P tests/ragged_sanitizer_cases.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np, jax, jax.numpy as jnp
from ragged_cases import MANY_UNITS, RaggedCase, ragged_jit
cpu, gpu = jax.devices("cpu")[0], jax.devices("gpu")[0]
cases = [
    # seed, seqs, head, layout, swizzle, bs, kv heads, q heads, max_q_len
    (1, ((37, 1), (50, 4), (70, 23), (21, 21), (9, 0), (33, 11)), 128, "HND", True, 16, 2, 8,
     None),
    (2, ((37, 1), (50, 4), (70, 23), (21, 21)), 64, "NHD", False, 12, 2, 8, None),
    (3, ((200, 70), (30, 30)), 256, "HND", True, 8, 1, 8, None),
    (4, ((3000, 4),), 128, "NHD", True, 16, 2, 8, None),          # split-KV + merge
    (5, ((129, 130), (64, 1)), 64, "HND", True, 32, 1, 1, None),  # q_len > kv_len, GQA 1
    # one-token sequences on the decode kernel, both kernels split-KV with their merges
    (6, ((3000, 4), (2500, 1), (40, 1), (0, 1)), 128, "HND", True, 16, 2, 8, None),
    # the few-row kernel alone (max_q_len 4 x GQA 4), split-KV, a sequence over the bound
    (7, ((3000, 4), (2500, 1), (40, 3), (0, 1), (60, 6)), 128, "NHD", True, 16, 2, 8, 4),
    # a bound over the ragged kernel's tiles: a chunk over it
    (8, ((37, 1), (50, 4), (70, 23), (33, 11)), 64, "HND", False, 16, 2, 8, 11),
    # 17 to 32 rows (GQA 4: 5 to 8 tokens, speculative decoding's 32 x 8) on the pipelined
    # kernel, split-KV (12 splits of 256), beside drafts of 8 rows, a decode token and a chunk
    (9, ((3000, 8), (700, 5), (40, 1), (60, 7), (9, 2), (80, 40)), 128, "HND", True, 16, 2, 8,
     None),
    # the same under max_q_len 8 (x GQA 4: over the few-row kernel's 16), linear scales, a
    # sequence over the bound
    (10, ((3000, 8), (2500, 1), (40, 6), (60, 9), (0, 1)), 128, "NHD", False, 16, 2, 8, 8),
    # 17 to 32 rows on the few-row kernel's wgmma path (sm_90a) with pages of 12 (a step's 64
    # positions over 6 pages, groups of 4 swizzled scales at every page edge), short sequences
    # (one masked step), more query tokens than cached ones
    (11, ((130, 8), (9, 6), (61, 7), (5, 7), (700, 5), (40, 1)), 128, "NHD", True, 12, 2, 8,
     None),
    # the same path alone under max_q_len 8 with split-KV, linear scales, pages of 20
    (12, ((3000, 8), (200, 8), (1, 1), (77, 6), (50, 9)), 128, "HND", False, 20, 2, 8, 8),
    # the wide kernel alone under max_q_len 8 also takes the drafts of 8 to 16 rows (2 to 4
    # tokens) and the one-token sequences, split-KV, swizzled scales
    (13, ((2000, 2), (900, 4), (40, 3), (33, 8), (600, 1), (0, 1)), 128, "HND", True, 16, 2, 8,
     8),
    # the same with one split (short contexts): its fill and NaN rows straight into the output
    (14, ((40, 8), (9, 2), (30, 9), (5, 1), (70, 5)), 128, "HND", True, 16, 2, 8, 8),
    # more pipelined units than a GPU has SMs twice over (8 kv heads, GQA 4: 320 units), so that
    # CTAs come in waves (a persistent CTA would take several: ragged v46, v47), a bound making
    # some of them NaN rows between units that attend, beside one-token, few-row and empty
    # sequences
    (15, MANY_UNITS, 128, "HND", True, 16, 8, 32, 40),
]
worst = 0.0
for seed, seqs, d, layout, swz, bs, kv, hq, bound in cases:
    with jax.default_device(cpu):
        c = RaggedCase(seed, seqs, head_size=d, layout=layout, v_scale_swizzle=swz, block_size=bs,
                       num_kv_heads=kv, pad_tokens=5)
        q = c.query(hq, jnp.bfloat16, seed=seed)
        ref = np.asarray(ragged_jit(*c.args(q), **c.options, max_q_len=bound)
                         .astype(jnp.float32))
    out = ragged_jit(*jax.device_put(c.args(q), gpu), **c.options, impl="kernel",
                     max_q_len=bound)
    out = np.asarray(out.astype(jnp.float32))
    nan = np.isnan(ref)                       # the rows over the bound: NaN on both paths
    if not np.array_equal(nan, np.isnan(out)):
        print(f"case {seed}: NaN rows differ from the jnp path's", flush=True)
        worst = np.nan
    out, ref = np.where(nan, 0.0, out), np.where(nan, 0.0, ref)
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    worst = np.nan if np.isnan(err) or np.isnan(worst) else max(worst, err)  # max() drops NaN
    print(f"case {seed}: d={d} {layout} swz={swz} bs={bs}: max err / max|ref| = {err:.2e}", flush=True)
print("worst", worst, "OK" if worst < 1e-2 else "FAIL")
# The exit status is the verdict (tests/gpu_checks.sh reads it).
sys.exit(0 if worst < 1e-2 else 1)
