"""Shared data for the ragged-attention tests (tests/test_ragged_attention.py): a filled NVFP4
cache (tests/attention_cases.py ``Case``) read by a packed batch of query tokens, and the dense
float64 reference of causal attention per query token.

``RaggedCase(seed, seqs)``: ``seqs`` is a list of ``(kv_len, q_len)``: sequence ``b`` has
``kv_len`` tokens in the cache, of which the last ``q_len`` are its query tokens (packed in
order into ``q``). After the real sequences come ``pad_seqs`` padding rows of ``block_tables``,
``seq_lens`` and ``cu_q_lens`` holding junk (out-of-range page ids, huge lengths, decreasing
offsets) that the readers must ignore, and after the real query tokens ``pad_tokens`` tokens
that no sequence owns (their outputs must be zeros).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4

from attention_cases import Case

OPTIONS = ("layout", "v_scale_swizzle", "sm_scale", "return_lse", "impl", "max_q_len")
ragged_jit = jax.jit(jax_nvfp4.ragged_paged_attention, static_argnames=OPTIONS)

#: A batch with more (pair of 64-row tiles, kv head) units of the pipelined prefill kernel than
#: an H100 or H200 has SMs twice over at 8 kv heads and GQA 4 (320 units on 132 SMs): 24
#: sequences of 20 to 60 query tokens over short contexts, beside a one-token, a few-row and an
#: empty sequence (test_ragged_attention.py and ragged_sanitizer_cases.py).
MANY_UNITS = tuple((q + (37 * i) % 150, q) for i, q in enumerate(
    20 + (13 * i) % 41 for i in range(24))) + ((40, 1), (90, 5), (12, 0))


class RaggedCase:
    def __init__(self, seed, seqs, *, num_kv_heads=2, head_size=128, layout="HND",
                 v_scale_swizzle=True, block_size=16, pad_seqs=2, pad_tokens=3, junk=True,
                 pad_columns=2):
        self.seqs = [(int(kv), int(q)) for kv, q in seqs]
        self.case = Case(seed, lens=[kv for kv, _ in self.seqs], num_kv_heads=num_kv_heads,
                         head_size=head_size, layout=layout, v_scale_swizzle=v_scale_swizzle,
                         block_size=block_size, junk=junk, pad_columns=pad_columns)
        rng = np.random.default_rng(seed + 7919)
        self.num_seqs = len(self.seqs)
        q_lens = np.array([q for _, q in self.seqs], np.int64)
        starts = np.concatenate([[0], np.cumsum(q_lens)])
        self.num_tokens = int(starts[-1]) + pad_tokens
        tables = self.case.tables
        cols = tables.shape[1]
        junk_rows = rng.integers(-5, 10 ** 6, (pad_seqs, cols)).astype(np.int32)
        self.tables = np.concatenate([tables, junk_rows]).astype(np.int32)
        self.seq_lens = np.concatenate(
            [[kv for kv, _ in self.seqs], rng.integers(-5, 10 ** 6, pad_seqs)]).astype(np.int32)
        # cu_q_lens past num_seqs: junk (decreasing, beyond num_tokens).
        junk_cu = rng.integers(-3, self.num_tokens + 50, pad_seqs)
        self.cu_q_lens = np.concatenate([starts, junk_cu]).astype(np.int32)
        self.starts = starts
        self.k_scale, self.v_scale = self.case.k_scale, self.case.v_scale
        self.cache = self.case.cache
        self.layout, self.swizzle = layout, v_scale_swizzle
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.capacity = cols * block_size

    @property
    def options(self):
        return dict(layout=self.layout, v_scale_swizzle=self.swizzle)

    def query(self, num_q_heads, dtype, seed=1):
        rng = np.random.default_rng(seed)
        return jnp.asarray(rng.standard_normal((self.num_tokens, num_q_heads, self.head_size)),
                           dtype)

    def args(self, q, num_seqs=None, cache=None):
        """Positional arguments of ragged_paged_attention."""
        num_seqs = self.num_seqs if num_seqs is None else num_seqs
        cache = self.cache if cache is None else cache
        return (q, cache, jnp.asarray(self.tables), jnp.asarray(self.seq_lens),
                jnp.asarray(self.cu_q_lens), jnp.asarray(num_seqs, jnp.int32), self.k_scale,
                self.v_scale)

    def run(self, q, eager=False, **kw):
        fn = jax_nvfp4.ragged_paged_attention if eager else ragged_jit
        return fn(*self.args(q), **self.options, **kw)

    def rows_over(self, max_q_len):
        """[num_tokens] bool: the tokens of the sequences with more than max_q_len query
        tokens (their rows are NaN under that bound)."""
        over = np.zeros(self.num_tokens, bool)
        for b, (_, q_len) in enumerate(self.seqs):
            if q_len > max_q_len:
                over[self.starts[b]:self.starts[b] + q_len] = True
        return over

    def token_ends(self):
        """[num_tokens]: positions each query token attends to (0 for padding tokens)."""
        ends = np.zeros(self.num_tokens, np.int64)
        for b, (kv, q_len) in enumerate(self.seqs):
            for j in range(q_len):
                ends[self.starts[b] + j] = min(max(kv - q_len + j + 1, 0), self.capacity)
        return ends

    def reference(self, q, sm_scale=None, return_lse=False):
        """float64 causal attention per query token (zeros, lse -inf, for padding tokens)."""
        qf = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
        num_q_heads = qf.shape[1]
        sm_scale = 1.0 / math.sqrt(self.head_size) if sm_scale is None else sm_scale
        group = num_q_heads // self.num_kv_heads
        out = np.zeros_like(qf)
        lse = np.full(qf.shape[:2], -np.inf)
        ends = self.token_ends()
        for b, (kv, q_len) in enumerate(self.seqs):
            k, v = self.case.k[b], self.case.v[b]
            for j in range(q_len):
                t = self.starts[b] + j
                end = ends[t]
                if end == 0:
                    continue
                for i in range(num_q_heads):
                    h = i // group
                    s = (k[:end, h] @ qf[t, i]) * sm_scale
                    p = np.exp(s - s.max())
                    out[t, i] = (p @ v[:end, h]) / p.sum()
                    lse[t, i] = s.max() + np.log(p.sum())
        return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=None)
def shared_case(seed, seqs, **kw):
    """A RaggedCase built once per argument set (on the CPU)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return RaggedCase(seed, seqs, **kw)
