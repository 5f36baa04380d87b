"""Benchmark of NVFP4 ragged paged attention (chunked prefill, prefix reuse, speculative decoding,
a mixed batch) against cuDNN's dense bf16 flash attention and this library's decode kernel.

    python benchmarks/prefill_bench.py              # the full grid (GPU); JSON + markdown + PNG
    python benchmarks/prefill_bench.py --quick      # tiny shapes, a smoke run (works on CPU)
    python benchmarks/prefill_bench.py --points chunked1x2048,spec32x4 --only ragged,decode
    python benchmarks/prefill_bench.py --spec-batches 16,48 --points spec16x8,spec32x8,spec48x8

Grid ("q over c": q new query tokens per sequence after c cached ones, seq_len = c + q, the
query tokens at positions c .. c + q - 1): chunked1x2048 (1 sequence, 2048 over 32768),
chunked8x512 (8 x 512 over 8192), prefix16x1024 (16 x 1024 over one shared 16384-token prefix:
the first 1024 page ids of every block-table row are the same pages, followed by each
sequence's own 64), spec32x4 and spec32x8 (32 sequences x 4 or 8 draft tokens over 8192) and
mixed16+2x1024 (16 decoding sequences at context 4096, one query token each, then 2 chunks of
1024 over 4096, in one packed call). 32 query heads over 8 kv heads, head size 128, pages of 16
tokens, HND, swizzled V scales, bf16 q. The cache is filled on the device as in
attention_bench.py (random codes, scale bytes 0x30..0x58, k_scale = v_scale = 3/448); every call
reads its own random page order (a fresh permutation of the cache's pages, the shared prefix
staying shared). --quick: the same kinds of point at contexts of at most 160 tokens.
--spec-batches B,...: also spec{B}x8, 32 x 8's shape at B sequences (the wide few-row kernel's
time against its grid: benchmarks/RESULTS.md, "The wide kernel against batch").

Methods, all in one run: ``ragged`` (jax_nvfp4.ragged_paged_attention, impl="auto": the CUDA
kernel on a GPU, the jnp path elsewhere); ``ragged_bound`` (speculative points: the same call
with ``max_q_len`` = the point's query tokens, which a verify step knows, so the few-row kernel
serves it alone: the targets take the faster of the two ragged rows); ``dense``
(jax.nn.dot_product_attention over dense bf16 caches [B, L, 8, 128] holding the dequantised
values of the NVFP4 pages of call 0, causal with the offset: query i of a q-token chunk over L keys sees keys <= L - q + i. cuDNN's masks
through JAX (fused_attention_stablehlo.MaskType: NO_MASK, PADDING, CAUSAL, PADDING_CAUSAL,
ALIBI) have no bottom-right causal and JAX's is_causal is top-left (tril of [T, S]), so the
exact mask is two cuDNN calls: the cached keys with no mask and the chunk's own q x q block with
CAUSAL (square: top-left is bottom-right there), merged by their log-sum-exps
(return_residual=True; JAX hands the lse back in bf16); a one-token group is one call with no
mask; XLA where cuDNN refuses, the label says which); ``dense_nc`` (one cuDNN call per group
with no mask over the same lengths: the masked triangle is extra work, 3.0% of the causal work
at the chunked and prefix points, 11% at the mixed batch's chunks, under 0.05% for speculative
decoding; credited with the causal FLOPs only); the target compares with the faster of the two
dense rows. ``decode`` (speculative points: jax_nvfp4.paged_attention, the decode kernel, batch
32 at context 8192, one token each, over the same pages); ``parts`` (mixed batch: its 16
decoding sequences through paged_attention and its 2 chunks through ragged_paged_attention, each
timed on its own, their sum reported as "sum of parts"); ``glue`` (the chaining glue of one step
with no attention).

Timing method: attention_bench.py's. n calls run in ONE compiled program, call i reading its own
query qs[i] + prev * 0 and block table tables[i] + int(prev[0, 0, 0] * 0) (prev: call i-1's
output), so each call depends on the previous one; wall time after block_until_ready, median of
several runs (store_bench._time_program), for chain lengths n1 < nm < n2; per call =
(t(n2) - t(n1)) / (n2 - n1), "lin" = slope nm..n2 over slope n1..nm. Two rounds over all methods
of a point; a row reports their mean and spread, and its kernels' device time a call from a
profiler trace of its longest chain (attention_bench.py's; `--no-profiler` skips it: the
bound row's kernels less the glue row's are the wide kernel's and its merge's, without the
launch gaps). The copy ceiling (store_bench.measure_ceiling)
and a bf16 matrix-product peak (an n x n x n jnp.dot chained 2 and 8 times) are measured in the
same run.

FLOPs and bytes: FLOPs = 4 x 128 x 32 x the sum over query tokens of the positions each attends
to (query j of a q-token chunk with seq_len s sees s - q + j + 1 positions). Bytes floor = the
NVFP4 pages read once (the unique pages of the block-table rows: the shared prefix counted once)
x 2 sides x 8 kv heads x 16 tokens x 72 bytes, over the measured copy ceiling (which counts read
+ write; attention only reads, so % of the floor can pass 100). q and the output are left out
(the log and the JSON give their share: at chunked1x2048 they are 0.8x the page bytes). A point
is compute-bound when its FLOPs at the matrix-product peak take longer than its bytes floor.
TFLOP/s are the causal FLOPs over the time; % of bytes floor is the floor over the time.
Targets (H200): chunked prefill and prefix reuse >= 0.8x the throughput of the best cuDNN dense
row; speculative decoding <= 1.3x the decode kernel's time; the mixed batch <= 1.2x the sum of its
parts.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time

# This folder's attention_bench (inputs, chains, the Method timer; importing it also sets
# XLA_PYTHON_CLIENT_MEM_FRACTION before any backend starts) and store_bench (the ceiling).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_bench as ab  # noqa: E402
import store_bench  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_nvfp4  # noqa: E402
from jax_nvfp4 import attention_primitive, ragged_primitive  # noqa: E402
from jax_nvfp4 import layout as nv_layout  # noqa: E402

DECODE_TARGET, RAGGED_TARGET = attention_primitive.DECODE_TARGET, ragged_primitive.RAGGED_TARGET
GiB = store_bench.GiB
BLOCK_SIZE, NUM_KV_HEADS = ab.BLOCK_SIZE, ab.NUM_KV_HEADS
NUM_Q_HEADS, HEAD_SIZE = ab.NUM_Q_HEADS, ab.HEAD_SIZE

# (name, kind, [(sequences, q_len, seq_len), ...] packed in this order, shared prefix tokens)
FULL_POINTS = [
    ("chunked1x2048", "chunked", [(1, 2048, 32768 + 2048)], 0),
    ("chunked8x512", "chunked", [(8, 512, 8192 + 512)], 0),
    ("prefix16x1024", "prefix", [(16, 1024, 16384 + 1024)], 16384),
    ("spec32x4", "spec", [(32, 4, 8192 + 4)], 0),
    ("spec32x8", "spec", [(32, 8, 8192 + 8)], 0),
    ("mixed16+2x1024", "mixed", [(16, 1, 4096), (2, 1024, 4096 + 1024)], 0),
]
QUICK_POINTS = [
    ("chunked1x32", "chunked", [(1, 32, 96 + 32)], 0),
    ("chunked2x16", "chunked", [(2, 16, 48 + 16)], 0),
    ("prefix2x16", "prefix", [(2, 16, 64 + 16)], 64),
    ("spec2x4", "spec", [(2, 4, 64 + 4)], 0),
    ("spec2x8", "spec", [(2, 8, 64 + 8)], 0),
    ("mixed2+2x16", "mixed", [(2, 1, 64), (2, 16, 48 + 16)], 0),
]

METHODS = ("ragged", "dense", "dense_nc", "decode", "parts", "glue")
#: cuDNN's two dense forms (the targets take the faster), as the targets name them.
DENSE_FORMS = {"dense": "cuDNN's exact-causal row (dense)",
               "dense_nc": "cuDNN's unmasked row (dense_nc)"}
KERNEL_TARGETS = {"ragged": RAGGED_TARGET, "ragged_bound": RAGGED_TARGET,
                  "part_chunks": RAGGED_TARGET,
                  "decode": DECODE_TARGET, "part_decode": DECODE_TARGET}
LABELS = {"ragged": "ragged nvfp4 (impl=auto)",
          "ragged_bound": "ragged nvfp4, max_q_len = q (impl=auto)",
          "decode": "decode kernel (paged_attention)",
          "part_decode": "part: decode seqs (paged_attention)",
          "part_chunks": "part: chunks (ragged)", "parts": "sum of parts (run separately)",
          "glue": "chain glue (no attention)"}



#: What runs instead of the kernels off a GPU.
OFF_GPU_LABELS = {"ragged": "ragged nvfp4 jnp path (impl=auto: no kernel on {platform})",
                  "ragged_bound": "ragged nvfp4 jnp path, max_q_len = q (impl=auto: no kernel "
                                  "on {platform})",
                  "decode": "decode jnp path (paged_attention: no kernel on {platform})"}


def label(method):
    """A method's row label: what ran."""
    if method not in OFF_GPU_LABELS:
        return LABELS[method]
    return store_bench.kernel_label(LABELS[method], OFF_GPU_LABELS[method])


# kind -> (row field, comparison, target, what): the issue's targets, in the benchmark.
TARGETS = {
    "chunked": ("vs_dense", ">=", 0.8, "throughput >= 0.8x the best cuDNN dense row"),
    "prefix": ("vs_dense", ">=", 0.8, "throughput >= 0.8x the best cuDNN dense row"),
    "spec": ("x_ref", "<=", 1.3, "time <= 1.3x the decode kernel (1 token, same batch)"),
    "mixed": ("x_ref", "<=", 1.2, "time <= 1.2x the sum of its parts"),
}


# ---------------------------------------------------------------------------------------------
# Accounting.


def attended_positions(q_len, seq_len):
    """Positions the q_len query tokens of a sequence of seq_len tokens attend to, summed:
    query j (at position seq_len - q_len + j) sees seq_len - q_len + j + 1 of them."""
    q_len, seq_len = int(q_len), int(seq_len)
    return q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2


def bottom_right_mask(q_len, kv_len):
    """[q_len, kv_len] bool: query i of a chunk that ends the kv_len keys sees keys
    <= kv_len - q_len + i (causal, aligned to the bottom right)."""
    keys = np.arange(kv_len)[None, :]
    return keys <= (kv_len - q_len + np.arange(q_len))[:, None]


def page_index(seq_lens, prefix_tokens):
    """Cache page of each (sequence, block) before permutation, -1 past a sequence's pages: the
    first prefix_tokens // 16 blocks of every row are the same pages (a shared prefix), the rest
    each row's own. Returns (index [batch, max_pages], number of distinct pages)."""
    if prefix_tokens % BLOCK_SIZE or (seq_lens < prefix_tokens).any():
        raise ValueError("the shared prefix must be whole pages inside every sequence")
    shared = prefix_tokens // BLOCK_SIZE
    pages = -(-seq_lens // BLOCK_SIZE)
    own = pages - shared
    first = shared + np.concatenate([[0], np.cumsum(own)[:-1]])
    j = np.arange(int(pages.max()))[None, :]
    index = np.where(j < shared, j, first[:, None] + j - shared)
    return np.where(j < pages[:, None], index, -1), int(shared + own.sum())


def workload(index, q_lens, seq_lens):
    """FLOPs and bytes of attending with these rows of a page index (accounting in the
    module docstring)."""
    pages = -(-seq_lens // BLOCK_SIZE)
    used = np.unique(np.concatenate([index[b, :p] for b, p in enumerate(pages)]))
    positions = sum(attended_positions(q, s) for q, s in zip(q_lens, seq_lens))
    num_tokens = int(np.sum(q_lens))
    return {"num_seqs": len(seq_lens), "num_tokens": num_tokens, "unique_pages": int(used.size),
            "flops": 4 * HEAD_SIZE * NUM_Q_HEADS * positions,
            "nvfp4_bytes": int(used.size) * 2 * NUM_KV_HEADS * BLOCK_SIZE
            * nv_layout.head_bytes(HEAD_SIZE),
            "dense_bytes": int(np.sum(seq_lens)) * NUM_KV_HEADS * HEAD_SIZE * 2 * 2,
            "q_out_bytes": 2 * num_tokens * NUM_Q_HEADS * HEAD_SIZE * 2,
            "max_pages": int(pages.max())}


def make_point(name, kind, groups, prefix_tokens):
    q_lens = np.concatenate([np.full(n, q, np.int64) for n, q, _ in groups])
    seq_lens = np.concatenate([np.full(n, s, np.int64) for n, _, s in groups])
    index, num_blocks = page_index(seq_lens, prefix_tokens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    point = {"name": name, "kind": kind, "prefix_tokens": prefix_tokens, "q_lens": q_lens,
             "seq_lens": seq_lens, "cu_q_lens": cu, "index": index, "num_blocks": num_blocks,
             "groups": [], "work": workload(index, q_lens, seq_lens)}
    row = 0
    for n, q, s in groups:  # dense attention runs one call per group of equal shapes
        point["groups"].append({"rows": (row, row + n), "tokens": (int(cu[row]), int(cu[row + n])),
                                "q_len": q, "seq_len": s})
        row += n
    point["extra_noncausal_pct"] = 100 * (sum(n * q * s for n, q, s in groups)
                                          / sum(n * attended_positions(q, s)
                                                for n, q, s in groups) - 1)
    return point


def spec_points(batches):
    """spec{B}x8 for each B: spec32x8's shape (its draft tokens and context, from FULL_POINTS)
    at B sequences."""
    _, kind, [(_, q_len, seq_len)], prefix = next(p for p in FULL_POINTS if p[0] == "spec32x8")
    return [(f"spec{b}x{q_len}", kind, [(b, q_len, seq_len)], prefix) for b in batches]


def make_points(quick, spec_batches=()):
    return [make_point(*p) for p in (QUICK_POINTS if quick else FULL_POINTS)
            + spec_points(spec_batches)]


def sub_workloads(point):
    """(method key, what it reads) for every method of a point: ``rows``/``tokens`` select the
    point's sequences and query tokens (``tokens`` None: the decode twin's own queries),
    ``seq_lens``/``q_lens`` are theirs, ``work`` their FLOPs and bytes."""
    everything = {"rows": (0, len(point["seq_lens"])), "tokens": (0, point["work"]["num_tokens"]),
                  "seq_lens": point["seq_lens"], "q_lens": point["q_lens"]}
    out = [("ragged", everything), ("dense", everything), ("dense_nc", everything)]
    if point["kind"] == "spec":  # the decode twin: one token per sequence at the cached context
        # A verify step knows its longest query (vLLM's max_query_len): the bound's call too.
        out.insert(1, ("ragged_bound", everything))
        context = point["seq_lens"] - point["q_lens"]
        out.append(("decode", dict(everything, seq_lens=context, q_lens=np.ones_like(context),
                                   tokens=None)))
    if point["kind"] == "mixed":
        for key, pick in (("part_decode", lambda g: g["q_len"] == 1),
                          ("part_chunks", lambda g: g["q_len"] != 1)):
            groups = [g for g in point["groups"] if pick(g)]
            r0, r1 = groups[0]["rows"][0], groups[-1]["rows"][1]
            out.append((key, {"rows": (r0, r1), "tokens": (groups[0]["tokens"][0],
                                                           groups[-1]["tokens"][1]),
                              "seq_lens": point["seq_lens"][r0:r1],
                              "q_lens": point["q_lens"][r0:r1]}))
    out.append(("glue", everything))
    for _, wl in out:
        r0, r1 = wl["rows"]
        wl["work"] = workload(point["index"][r0:r1], wl["q_lens"], wl["seq_lens"])
    return out


def selected(key, only):
    return ("parts" if key.startswith("part_") else "ragged" if key == "ragged_bound"
            else key) in only


# ---------------------------------------------------------------------------------------------
# Dense attention with the chunk's causal offset.


def bottom_right_attention(q, k_past, v_past, k_new, v_new, implementation=None):
    """q [B, T, Hq, D] (T new tokens) over S - T cached keys (k_past [B, S - T, Hkv, D]) and
    the T new ones (k_new [B, T, Hkv, D]), causal aligned to the bottom right: query i sees
    every cached key and new keys <= i. Two jax.nn.dot_product_attention calls (no mask; causal
    on the square T x T block, where top-left and bottom-right agree) merged by their
    log-sum-exps."""
    kwargs = {} if implementation is None else {"implementation": implementation}
    o1, l1 = jax.nn.dot_product_attention(q, k_past, v_past, return_residual=True, **kwargs)
    o2, l2 = jax.nn.dot_product_attention(q, k_new, v_new, is_causal=True, return_residual=True,
                                          **kwargs)
    l1, l2 = l1.astype(jnp.float32), l2.astype(jnp.float32)
    top = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - top)[..., None], jnp.exp(l2 - top)[..., None]
    out = (o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)
    return out.astype(q.dtype)


def dense_variants(exact):
    """(implementation, masking) to try in order, from what this jax's signature accepts."""
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    impls = ["cudnn", "xla"] if "implementation" in params else [None]
    if not exact:
        return [(i, "noncausal") for i in impls]
    split = [(i, "split") for i in impls] if "return_residual" in params else []
    return split + [(impls[-1], "mask")]


def dense_label(implementation, masking):
    how = {"split": "exact causal: cached keys unmasked + chunk causal, lse merge",
           "mask": "exact causal: boolean mask",
           "noncausal": "no mask over the same lengths"}[masking]
    who = {"cudnn": "cuDNN", "xla": "XLA", None: "default"}[implementation]
    return f"dense bf16 {who} ({how})"


def dense_group(q, arrays, masking, implementation):
    kwargs = {} if implementation is None else {"implementation": implementation}
    if masking == "noncausal":
        return jax.nn.dot_product_attention(q, arrays["k"], arrays["v"], **kwargs)
    if "k_past" not in arrays:  # q_len 1 (nothing to mask) or q_len == seq_len (plain causal)
        return jax.nn.dot_product_attention(q, arrays["k"], arrays["v"], is_causal=q.shape[1] > 1,
                                            **kwargs)
    if masking == "split":
        return bottom_right_attention(q, arrays["k_past"], arrays["v_past"], arrays["k_new"],
                                      arrays["v_new"], implementation)
    k, v = (jnp.concatenate([arrays[f"{x}_past"], arrays[f"{x}_new"]], axis=1) for x in "kv")
    mask = jnp.asarray(bottom_right_mask(q.shape[1], k.shape[1]))[None, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, **kwargs)


def dense_attn(groups, implementation, masking):
    def attn(q, table, lens, a):
        outs = []
        for g, arrays in zip(groups, a["groups"]):
            (t0, t1), q_len = g["tokens"], g["q_len"]
            qg = q[t0:t1].reshape(-1, q_len, NUM_Q_HEADS, HEAD_SIZE)
            outs.append(dense_group(qg, arrays, masking, implementation).reshape(q[t0:t1].shape))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return attn


def ragged_attn(q, table, lens, a, max_q_len=None):
    return jax_nvfp4.ragged_paged_attention(
        q, a["nvfp4"], table, lens["seq_lens"], lens["cu_q_lens"], lens["num_seqs"],
        a["k_scale"], a["v_scale"], layout="HND", v_scale_swizzle=True, impl="auto",
        max_q_len=max_q_len)


def glue_attn(q, table, lens, a):
    # Consumes the table and the lengths (their glue stays); the barrier keeps XLA from fusing
    # the chain into one elementwise kernel.
    touch = table[0, 0] + lens["seq_lens"][0] + lens["cu_q_lens"][-1]
    return jax.lax.optimization_barrier(q + touch.astype(q.dtype) * 0)


# ---------------------------------------------------------------------------------------------
# Inputs (on the device) and methods.


def calls_for(point, args):
    q_bytes = point["work"]["num_tokens"] * NUM_Q_HEADS * HEAD_SIZE * 2
    return int(min(args.max_chain, max(args.min_chain, args.q_budget_bytes // q_bytes)))


@functools.partial(jax.jit, static_argnums=2)
def _gather_dense(pages, table, seq_len):
    """pages [num_blocks, 16, H, D], table [B, P] -> [B, seq_len, H, D] in position order."""
    return pages[table].reshape(table.shape[0], -1, NUM_KV_HEADS, HEAD_SIZE)[:, :seq_len]


def _dense_caches(point, k_pages, v_pages, table0, exact, noncausal):
    """Per group: the sequences' dequantised K/V laid out densely ([B, seq_len, 8, 128] bf16),
    split into cached + new for the exact masking."""
    out = []
    for g in point["groups"]:
        (r0, r1), q_len, seq_len = g["rows"], g["q_len"], g["seq_len"]
        tab = jnp.asarray(table0[r0:r1, :-(-seq_len // BLOCK_SIZE)])
        k, v = (_gather_dense(x, tab, seq_len) for x in (k_pages, v_pages))
        arrays = {}
        if exact and 1 < q_len < seq_len:
            cut = seq_len - q_len
            arrays.update(k_past=k[:, :cut], v_past=v[:, :cut], k_new=k[:, cut:], v_new=v[:, cut:])
        if noncausal or not arrays:
            arrays.update(k=k, v=v)
        out.append(ab._ready(arrays))
    return out


def make_inputs(point, keys_wanted, n_calls, key):
    k_q, k_table, k_cache, k_decode = jax.random.split(key, 4)
    num_tokens = point["work"]["num_tokens"]
    inputs = {
        "qs": jax.jit(ab._normal, static_argnums=1)(
            k_q, (n_calls, num_tokens, NUM_Q_HEADS, HEAD_SIZE)),
        "tables": jax.jit(ab._tables, static_argnums=(2, 3))(
            k_table, jnp.asarray(point["index"], jnp.int32), point["num_blocks"], n_calls),
        "nvfp4": {"nvfp4": jax.jit(ab._fill_nvfp4, static_argnums=1)(k_cache,
                                                                      point["num_blocks"]),
                  "k_scale": jnp.float32(ab.K_SCALE), "v_scale": jnp.float32(ab.V_SCALE)},
    }
    if "decode" in keys_wanted:
        inputs["qs_decode"] = jax.jit(ab._normal, static_argnums=1)(
            k_decode, (n_calls, len(point["seq_lens"]), NUM_Q_HEADS, HEAD_SIZE))
    exact, noncausal = "dense" in keys_wanted, "dense_nc" in keys_wanted
    if exact or noncausal:
        nv = inputs["nvfp4"]
        k_pages, v_pages = jax.jit(jax_nvfp4.dequantize)(nv["nvfp4"], nv["k_scale"], nv["v_scale"])
        inputs["dense"] = _dense_caches(point, k_pages, v_pages, np.asarray(inputs["tables"][0]),
                                        exact, noncausal)
        ab.free((k_pages, v_pages))
    return ab._ready(inputs)


def method_args(key, wl, inputs):
    """(qs, tables, lens, arrays) of one method, each call's slices of the point's inputs."""
    (r0, r1), pages = wl["rows"], wl["work"]["max_pages"]
    whole = r0 == 0 and r1 == inputs["tables"].shape[1] and pages == inputs["tables"].shape[2]
    tables = inputs["tables"] if whole else inputs["tables"][:, r0:r1, :pages]
    if key == "decode":
        qs = inputs["qs_decode"]
    elif wl["tokens"] == (0, inputs["qs"].shape[1]):
        qs = inputs["qs"]
    else:
        qs = inputs["qs"][:, wl["tokens"][0]:wl["tokens"][1]]
    seq_lens = jnp.asarray(wl["seq_lens"], jnp.int32)
    if key in ("decode", "part_decode"):
        return qs, tables, seq_lens, inputs["nvfp4"]
    if key in DENSE_FORMS:
        return qs, tables, {}, {"groups": inputs["dense"]}
    lens = {"seq_lens": seq_lens, "num_seqs": jnp.int32(len(wl["seq_lens"])),
            "cu_q_lens": jnp.asarray(np.concatenate([[0], np.cumsum(wl["q_lens"])]), jnp.int32)}
    return qs, tables, lens, (inputs["nvfp4"] if key != "glue" else {})


class PrefillMethod(ab.Method):
    """attention_bench's Method (programs, carry, rounds) over arguments given whole."""

    def __init__(self, key, label, attn, args, wl, implementation=None):
        qs, tables, lens, arrays = args
        super().__init__("glue", label, attn, {"qs": qs, "tables": tables, "lens": lens,
                                               "arrays": {}})
        self.key, self.args, self.wl, self.implementation = key, args, wl, implementation


def candidates(key, point):
    """(label, attn, implementation) to try in order for one method at one point."""
    if key in DENSE_FORMS:
        return [(dense_label(*v), dense_attn(point["groups"], *v), v[0])
                for v in dense_variants(key == "dense")]
    bound = functools.partial(ragged_attn, max_q_len=int(np.max(point["q_lens"])))
    attn = {"ragged": ragged_attn, "ragged_bound": bound, "part_chunks": ragged_attn,
            "glue": glue_attn, "decode": ab.nvfp4_attn("auto"),
            "part_decode": ab.nvfp4_attn("auto")}[key]
    return [(label(key), attn, None)]


def build_methods(point, specs, inputs, args, n_calls, log, skipped):
    on_gpu = jax.devices()[0].platform == "gpu"
    built = []
    for key, wl in specs:
        for label, attn, implementation in candidates(key, point):
            method = PrefillMethod(key, label, attn, method_args(key, wl, inputs), wl,
                                   implementation)
            try:
                single = method.start(check_hlo=on_gpu and key in KERNEL_TARGETS)
            except Exception as e:  # noqa: BLE001  (a variant that does not run: the next one)
                method.close()
                skipped.append({"point": point["name"], "method": label, "why": ab._first_line(e)})
                log(f"  {label}: does not run here ({ab._first_line(e)})")
                continue
            cap = min(n_calls, args.max_chain_dense if key.startswith("dense") else args.max_chain)
            n_min = args.min_chain if single <= 0.01 else min(args.min_chain, 4)
            method.lengths = ab.chain_lengths(single, args.target_seconds, n_min, max(cap, n_min))
            built.append(method)
            break
    return built


def sanity(point, built, log):
    """First outputs (same q, same block table): ragged against the exact dense attention over
    the same dequantised values, and against its parts; kernels present in the compiled HLO."""
    by_key = {m.key: m for m in built}
    out = {}
    platform = jax.devices()[0].platform
    for m in built:
        if not np.isfinite(m.first_out).all():
            log(f"  WARNING: {m.label}: first output is not finite")
            out[f"{m.key}_finite"] = False
        target = KERNEL_TARGETS.get(m.key)
        if target and platform == "gpu":
            out[f"{m.key}_kernel"] = ran = target in m.lowered_text
            if not ran:
                log(f"  WARNING: {m.label}: no {target} call in the compiled HLO: the jnp path ran")
    ragged = by_key.get("ragged")
    if ragged is None:
        return out
    log(f"  sanity: ragged output finite: {bool(np.isfinite(ragged.first_out).all())} "
        f"(max |out| {np.nanmax(np.abs(ragged.first_out)):.3g}; "
        f"{'kernel' if out.get('ragged_kernel') else 'jnp path'} on {platform})")
    if "dense" in by_key:
        out["ragged_vs_dense"] = err = ab._rel_err(ragged.first_out, by_key["dense"].first_out)
        log(f"  sanity: |ragged - dense| / |dense| = {err:.2e} (dense over the dequantised pages, "
            f"{by_key['dense'].label})" + ("  WARNING: large" if err > 0.05 else ""))
    if "part_decode" in by_key and "part_chunks" in by_key:
        parts = np.concatenate([by_key["part_decode"].first_out, by_key["part_chunks"].first_out])
        out["ragged_vs_parts"] = err = ab._rel_err(ragged.first_out, parts)
        log(f"  sanity: |mixed - parts| / |parts| = {err:.2e}" + ("  WARNING: large" if err > 0.05
                                                                  else ""))
    return out


# ---------------------------------------------------------------------------------------------
# Timing and rows.


def time_rounds(point, built, args, log, skipped):
    """Two rounds over the methods (the second over n1 and n2 only); a method whose timing
    fails leaves the run."""
    alive = list(built)
    for lengths_of in (lambda m: m.lengths, lambda m: m.lengths[::2]):
        for method in list(alive):
            try:
                method.time_round(lengths_of(method), args.repeats)
            except Exception as e:  # noqa: BLE001  (e.g. out of memory in a long chain)
                log(f"  {method.label}: timing failed ({ab._first_line(e)})")
                skipped.append({"point": point["name"], "method": method.label,
                                "why": ab._first_line(e)})
                method.close()
                alive.remove(method)
    return alive


def make_row(point, key, label, rounds, work, ceiling_bps, peak_flops, extra=None):
    r1, r2 = rounds
    t = (r1 + r2) / 2
    flops = None if key == "glue" else work["flops"]
    floor = work["nvfp4_bytes"] / ceiling_bps
    row = {"point": point["name"], "kind": point["kind"], "method": key, "label": label,
           "us_per_call": t * 1e6, "us_round1": r1 * 1e6, "us_round2": r2 * 1e6,
           "spread_pct": 100 * abs(r1 - r2) / t if t > 0 else float("nan"),
           "flops": flops, "nvfp4_bytes": work["nvfp4_bytes"], "floor_us": floor * 1e6,
           "tflops": flops / t / 1e12 if flops and t > 0 else None,
           "pct_peak": 100 * flops / t / peak_flops if flops and t > 0 else None,
           "pct_floor": 100 * floor / t if key != "glue" and t > 0 else None,
           "regime": regime(work, ceiling_bps, peak_flops),
           "linearity": None, "chain_lengths": None, "implementation": None,
           "vs_dense": None, "x_ref": None, "ref": None, "kernels_us_per_call": None}
    row.update(extra or {})
    return row


def regime(work, ceiling_bps, peak_flops):
    return "compute" if work["flops"] / peak_flops > work["nvfp4_bytes"] / ceiling_bps else "memory"


def point_rows(point, alive, ceiling_bps, peak_flops):
    rows = [make_row(point, m.key, m.label, m.rounds, m.wl["work"], ceiling_bps, peak_flops,
                     {"linearity": m.linearity, "chain_lengths": list(m.lengths),
                      "implementation": m.implementation,
                      "kernels_us_per_call": m.extra.get("kernels_us_per_call")})
            for m in alive if len(m.rounds) == 2]
    parts = [r for r in rows if r["method"].startswith("part_")]
    if len(parts) == 2:
        rounds = [sum(r[f"us_round{i}"] for r in parts) / 1e6 for i in (1, 2)]
        work = {k: sum(r[k] for r in parts) for k in ("flops", "nvfp4_bytes")}
        kernels = [r["kernels_us_per_call"] for r in parts]
        rows.append(make_row(point, "parts", label("parts"), rounds, work, ceiling_bps,
                             peak_flops, {"kernels_us_per_call": None if None in kernels
                                          else sum(kernels)}))
    return rows


def add_ratios(rows):
    """vs_dense: the best dense row's time over this row's (a throughput ratio, same FLOPs);
    x_ref: the ragged row's time over its reference's (spec: decode, mixed: sum of parts)."""
    for name in dict.fromkeys(r["point"] for r in rows):
        same = {r["method"]: r for r in rows if r["point"] == name}
        dense = [same[k] for k in DENSE_FORMS if k in same and same[k]["us_per_call"] > 0]
        best = min(dense, key=lambda r: r["us_per_call"]) if dense else None
        for r in same.values():
            if best and r["method"] in ("ragged", "ragged_bound", "parts", *DENSE_FORMS) \
                    and r["us_per_call"] > 0:
                r["vs_dense"] = best["us_per_call"] / r["us_per_call"]
                r["dense_ref"] = best["label"]
        ref = same.get({"spec": "decode", "mixed": "parts"}.get(same[next(iter(same))]["kind"]))
        for ragged in (same.get("ragged"), same.get("ragged_bound")):
            if ref and ragged and ref["us_per_call"] > 0:
                ragged["x_ref"] = ragged["us_per_call"] / ref["us_per_call"]
                ragged["ref"] = ref["label"]


def evaluate_targets(result):
    rows = {(r["point"], r["method"]): r for r in result["rows"]}
    checks = []
    for p in result["points"]:
        field, op, target, what = TARGETS[p["kind"]]
        # The faster of the ragged rows (speculative decoding: with and without max_q_len).
        found = [r for r in (rows.get((p["name"], k)) for k in ("ragged", "ragged_bound"))
                 if r is not None and r[field] is not None]
        r = min(found, key=lambda x: x["us_per_call"]) if found else None
        value = None if r is None else r[field]
        check = {"point": p["name"], "target": what, "value": None, "status": "not run"}
        if value is not None:
            met = value >= target if op == ">=" else value <= target
            ref_key = r["dense_ref"] if field == "vs_dense" else r["ref"]
            ref_row = next(x for x in result["rows"]
                           if x["point"] == p["name"] and x["label"] == ref_key)
            note = ""
            if field == "vs_dense" and ref_row.get("implementation") != "cudnn":
                note = " (no cuDNN baseline here)"
            elif field == "vs_dense":
                # The target takes the faster of cuDNN's two forms: with one not run (--only),
                # a "met" may not hold against it.
                absent = [DENSE_FORMS[k] for k in DENSE_FORMS if (p["name"], k) not in rows]
                if absent:
                    note = (f" ({' and '.join(absent)} not run; the target takes the faster of "
                            "both)")
            check.update(status="met" if met else "missed",
                         value=f"{value:.2f}x ({r['label']} {r['us_per_call']:.1f} us, "
                               f"{ref_row['label']} {ref_row['us_per_call']:.1f} us){note}",
                         ratio=value, within_noise=abs(value - target) / target * 100
                         < max(r["spread_pct"], ref_row["spread_pct"]))
        checks.append(check)
    return checks


# ---------------------------------------------------------------------------------------------


def measure_matmul_peak(n, repeats):
    """bf16 FLOP/s of an n x n x n jnp.dot (float32 accumulation), chained calls queued back to
    back (store_bench._async_time)."""
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.jit(ab._normal, static_argnums=1)(k1, (n, n))
    w = (jax.jit(ab._normal, static_argnums=1)(k2, (n, n)) / np.sqrt(n)).astype(jnp.bfloat16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                  .astype(jnp.bfloat16))
    seconds, _ = store_bench._async_time(lambda a: dot(a, w), x, 2, 8, repeats)
    return 2 * n ** 3 / max(seconds, 1e-12)


def jnp_path_too_big(key, wl, budget):
    """Why a paged reader is left out where its jnp path would run (no CUDA kernel here) and
    would need more than the budget (every query token gathers all pages of its row, float32),
    else None."""
    kernel = {"ragged": ragged_primitive, "part_chunks": ragged_primitive,
              "decode": attention_primitive, "part_decode": attention_primitive}.get(key)
    if kernel is None or (jax.devices()[0].platform == "gpu"
                          and kernel.kernel_supports(HEAD_SIZE)):
        return None
    w = wl["work"]
    need = ab.jnp_memory_estimate(
        {"padded_tokens": w["num_tokens"] * w["max_pages"] * BLOCK_SIZE}, "jnp")
    if need <= budget:
        return None
    return f"jnp path (no CUDA kernel here): ~{need / GiB:.3g} GiB > budget {budget / GiB:.3g} GiB"


def run_point(point, args, ceiling_bps, peak_flops, key, log):
    specs, skipped, built = [], [], []
    for k, wl in sub_workloads(point):
        why = jnp_path_too_big(k, wl, args.jnp_budget) if selected(k, args.only) else "not asked"
        if why is None:
            specs.append((k, wl))
        elif why != "not asked":
            skipped.append({"point": point["name"], "method": label(k), "why": why})
            log(f"  skip {label(k)}: {why}")
    n_calls = calls_for(point, args)
    inputs = make_inputs(point, {k for k, _ in specs}, n_calls, key)
    try:
        built = build_methods(point, specs, inputs, args, n_calls, log, skipped)
        point["sanity"] = sanity(point, built, log)
        built = time_rounds(point, built, args, log, skipped)
        ab.record_kernels_times(built, args.profiler, log)
        return point_rows(point, built, ceiling_bps, peak_flops), skipped
    finally:
        for method in built:
            method.close()
        ab.free(inputs)
        jax.clear_caches()


def _point_json(point):
    keep = ("name", "kind", "prefix_tokens", "num_blocks", "work", "extra_noncausal_pct",
            "sanity", "regime")
    out = {k: point[k] for k in keep if k in point}
    out.update(q_lens=point["q_lens"].tolist(), seq_lens=point["seq_lens"].tolist(),
               groups=point["groups"])
    return out


def _log(text):
    print(text, flush=True)


def run(args, log=_log):
    device = jax.devices()[0]
    result = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d")}
    log("device: {device} ({platform}), jax {jax}, date {date}".format(**result))
    if not store_bench.on_gpu():
        log(store_bench.smoke_run_note())
    result["ceiling"] = ceiling = store_bench.measure_ceiling(args.ceiling_bytes, args.repeats)
    ceil_bps = ceiling["ceiling_Bps"]
    result["matmul_peak_flops"] = peak = measure_matmul_peak(args.matmul_n, args.repeats)
    log(f"ceiling {store_bench.rate_text(ceil_bps)} (read + write, "
        f"{args.ceiling_bytes / GiB:.2f} GiB); "
        f"bf16 matrix product {peak / 1e12:.1f} TFLOP/s ({args.matmul_n}^3)")
    key = jax.random.key(args.seed)
    rows, skipped = [], []
    for i, point in enumerate(args.points):
        w = point["work"]
        point["regime"] = regime(w, ceil_bps, peak)
        log(f"{point['name']}: {w['num_seqs']} sequences, {w['num_tokens']} query tokens, "
            f"{w['flops'] / 1e9:.1f} GFLOP (at the peak {w['flops'] / peak * 1e6:.1f} us), "
            f"{w['unique_pages']} pages, NVFP4 {w['nvfp4_bytes'] / 1e6:.1f} MB (floor "
            f"{w['nvfp4_bytes'] / ceil_bps * 1e6:.1f} us): {point['regime']}-bound; q + out "
            f"{w['q_out_bytes'] / w['nvfp4_bytes']:.2f}x the page bytes, not counted")
        try:
            new_rows, new_skipped = run_point(point, args, ceil_bps, peak,
                                              jax.random.fold_in(key, i), log)
        except Exception as e:  # noqa: BLE001  (e.g. the inputs do not fit: the next point)
            log(f"  {point['name']} failed: {ab._first_line(e)}")
            new_rows, new_skipped = [], [{"point": point["name"], "method": "all",
                                          "why": ab._first_line(e)}]
            jax.clear_caches()
        for r in new_rows:
            lin = "" if r["linearity"] is None else f" lin {r['linearity']:.2f}"
            kernels = ("" if r.get("kernels_us_per_call") is None
                       else f"; kernels {r['kernels_us_per_call']:.1f} us")
            log(f"  {r['label']:<44.44} {r['us_per_call']:10.1f} us (rounds {r['us_round1']:.1f},"
                f" {r['us_round2']:.1f}{lin}{kernels}) {ab._fmt(r['tflops'], '7.1f')} TFLOP/s "
                f"{ab._fmt(r['pct_floor'], '6.1f')}% of bytes floor")
            if not args.quick and r["linearity"] is not None and not 0.8 <= r["linearity"] <= 1.25:
                log(f"  WARNING: {r['label']}: chain time not linear (lin {r['linearity']:.2f})")
        rows += new_rows
        skipped += new_skipped
    add_ratios(rows)
    geometry = dict(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                    block_size=BLOCK_SIZE, layout="HND", v_scale_swizzle=True)
    result.update(matmul_n=args.matmul_n, points=[_point_json(p) for p in args.points],
                  rows=rows, skipped=skipped,
                  config=dict(geometry, **{k: getattr(args, k) for k in
                                           ("repeats", "seed", "quick", "only")}),
                  method_note="\n\n".join(__doc__.split("\n\n")[4:6]))
    # The targets are the GPU kernels': off a GPU nothing ran that they are about.
    result["targets"] = evaluate_targets(result) if store_bench.on_gpu() else []
    return result


# ---------------------------------------------------------------------------------------------
# Output.


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")  # no display
    from matplotlib import pyplot as plt

    names = list(dict.fromkeys(r["point"] for r in result["rows"]))  # points with rows
    methods = list(dict.fromkeys(r["method"] for r in result["rows"] if r["method"] != "glue"))
    if not methods:
        return
    rows = {(r["point"], r["method"]): r for r in result["rows"]}
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    x, width = np.arange(len(names)), 0.8 / len(methods)
    for i, m in enumerate(methods):
        times = [rows[(n, m)]["us_per_call"] if (n, m) in rows else np.nan for n in names]
        label = next(rows[(n, m)]["label"] for n in names if (n, m) in rows)
        axes[0].bar(x - 0.4 + width * (i + 0.5), times, width, label=label)
    axes[0].set(yscale="log", ylabel="µs per call (log)",
                title=f"ragged paged attention, {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv heads, "
                      f"D={HEAD_SIZE} ({result['device']})")
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    checks = {c["point"]: c for c in result["targets"]}
    kinds = {p["name"]: p["kind"] for p in result["points"]}
    for j, n in enumerate(names):
        field, _, target, _ = TARGETS[kinds[n]]
        check = checks.get(n, {})  # off a GPU no target is judged: no check, a gray bar
        value = check.get("ratio")
        color = {"met": "tab:green", "missed": "tab:red"}.get(check.get("status"), "gray")
        axes[1].bar(j, np.nan if value is None else value, 0.6, color=color)
        axes[1].plot([j - 0.4, j + 0.4], [target, target], "k-", lw=1.5)
        axes[1].text(j, target, " vs dense" if field == "vs_dense" else " x ref", fontsize=7,
                     va="bottom", ha="center")
    axes[1].set(ylabel="ratio (black: the target)",
                title="targets: vs dense = dense time / ragged time (higher is better); "
                      "x ref = ragged time / reference time (lower is better)")
    axes[1].title.set_fontsize(8)
    for ax in axes:
        ax.set_xticks(x, names, rotation=20)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets_text(result):
    if result["platform"] != "gpu":
        return (f"Targets (ragged_paged_attention): not evaluated on {result['platform']} "
                f"(GPU targets)")
    lines = ["Targets (ragged_paged_attention" + (", quick shapes: not the issue's" if
                                                  result["config"]["quick"] else "") + "):"]
    for c in result["targets"]:
        noise = " (margin within the timing spread)" if c.get("within_noise") else ""
        lines.append(f"  {c['point']:<15} {c['target']:<52} {c['status']:<7} "
                     f"{c['value'] or '-'}{noise}")
    return "\n".join(lines)


def markdown(result):
    c, peak = result["ceiling"], result["matmul_peak_flops"]
    lines = [f"Device: {result['device']}, jax {result['jax']}, {result['date']}. Ceiling "
             f"{store_bench.rate_text(c['ceiling_Bps'])} (read + write), bf16 matrix product "
             f"{peak / 1e12:.1f} TFLOP/s ({result['matmul_n']}^3). {NUM_Q_HEADS} q / "
             f"{NUM_KV_HEADS} kv heads, head size {HEAD_SIZE}, pages of {BLOCK_SIZE}, HND, "
             "swizzled V scales. TFLOP/s: causal FLOPs over the time (dense_nc does more); % of "
             "bytes floor: the row's NVFP4 pages (read once) at the ceiling over its time (for "
             "dense rows the point's NVFP4 floor too); vs dense: the best dense row's time over "
             "this row's (throughput ratio); x ref: this row's time over the decode reader's "
             "(spec) or the sum of the parts (mixed). Spread: the two timings apart. Kernels' "
             "µs: the device time of the chain's kernels a call, from a profiler trace (no "
             "launch gaps; the chain's glue kernels in it: the glue row has them alone).", "",
             "| point | bound | method | µs / call | spread % | TFLOP/s | % of peak | "
             "% of bytes floor | vs dense | x ref | kernels' µs / call (profiler) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in result["points"]:
        rows = [r for r in result["rows"] if r["point"] == p["name"]]
        for r in rows:
            lines.append(
                f"| {r['point']} | {r['regime']} | {r['label']} | {r['us_per_call']:.1f} | "
                f"{r['spread_pct']:.1f} | {ab._fmt(r['tflops'], '.1f')} | "
                f"{ab._fmt(r['pct_peak'], '.1f')} | {ab._fmt(r['pct_floor'], '.1f')} | "
                f"{ab._fmt(r['vs_dense'], '.2f')} | {ab._fmt(r['x_ref'], '.2f')} | "
                f"{ab._fmt(r.get('kernels_us_per_call'), '.1f')} |")
        if rows:
            w = p["work"]
            lines.append(f"| {p['name']} | | floor: NVFP4 pages ({w['unique_pages']} pages, "
                         f"{w['nvfp4_bytes'] / 1e6:.1f} MB) | "
                         f"{w['nvfp4_bytes'] / c['ceiling_Bps'] * 1e6:.1f} | | | | 100.0 | | | |")
            lines.append(f"| {p['name']} | | floor: FLOPs at the matrix-product peak "
                         f"({w['flops'] / 1e9:.1f} GFLOP) | {w['flops'] / peak * 1e6:.1f} | | "
                         f"{peak / 1e12:.1f} | 100.0 | | | | |")
    return "\n".join(lines)


def add_spec_batches(parser):
    parser.add_argument("--spec-batches", type=lambda s: [int(b) for b in s.split(",")],
                        default=[], metavar="B,...",
                        help="also the points spec{B}x8: spec32x8's shape at B sequences")


def parse_args(argv):
    p = ab.timing_options(__doc__.split("\n\n")[0], METHODS, "chunked1x2048,spec32x4")
    p.add_argument("--q-budget-gib", type=float, default=4.0,
                   help="memory for the per-call queries of a point (bounds the chain length)")
    p.add_argument("--matmul-n", type=int, default=None,
                   help="size of the peak matrix product (default 8192, quick 256)")
    add_spec_batches(p)
    args = p.parse_args(argv)
    # option: (full grid, --quick), where the command line leaves it out
    defaults = {"repeats": (7, 3), "target_seconds": (0.05, 0.0), "max_chain": (200, 3),
                "min_chain": (8, 3), "ceiling_gib": (2, 1 / 16), "matmul_n": (8192, 256)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)
    args.only = ab._csv(args.only, METHODS, "method")
    args.ceiling_bytes = int(args.ceiling_gib * GiB)
    args.q_budget_bytes = int(args.q_budget_gib * GiB)
    args.jnp_budget = int(args.jnp_budget_gib * GiB) if args.jnp_budget_gib else ab.memory_budget()
    grid = make_points(args.quick, args.spec_batches)
    names = [p["name"] for p in grid]
    wanted = ab._csv(args.points, names, "point") if args.points else names
    args.points = [p for p in grid if p["name"] in wanted]
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    result = run(args)
    table, targets = markdown(result), targets_text(result)
    store_bench.write_outputs(args.out, "prefill_bench", result, targets + "\n\n" + table, plot,
                              json_default=int)
    print(f"\n{targets}\n\n{table}", flush=True)
    return result


if __name__ == "__main__":
    main()
