"""What a KV-cache format costs in quality: held-out bits per byte of a trained model.

    python benchmarks/quality_bench.py           # the full tables, on the CPU in a few minutes
    python benchmarks/quality_bench.py --quick   # a smoke run: a few windows, short decodes

The model is the byte-level transformer of examples/tiny_lm.py with the shipped weights
(examples/tiny_lm.npz, trained by examples/train_tiny_lm.py on the Python standard library's
source; 4 layers, 8 query / 2 kv heads of 64, RoPE). It reads the held-out files' windows
(examples/stdlib_corpus.py; 257 bytes, up to 4 per file, the score of 256 bytes each) with the
model computing in float32 and only the KV cache changing:

* **teacher-forced, every position:** in every layer, the K and V of every position make a round
  trip through the cache format (quantise, read back) before attention, so each position
  attends to what a cache would hand back, its own token included (a decode step stores the
  token, then attends). NVFP4 uses the library's own quantiser
  (:func:`jax_nvfp4.reference.quantize_blocks`, the bytes the store kernels write) and reads
  values back as docs/format.md §1 defines them;
* **the real decode path on a few sequences:** examples/paged_decode.py's decode step
  (``jax_nvfp4.reshape_and_cache`` into a paged cache, then ``jax_nvfp4.paged_attention``, one
  token at a time from position 0) for the NVFP4 and bf16 caches, compared with the
  teacher-forced logits of the same windows: the two must agree (``DECODE_BOUNDS``).

Formats (bits per stored value in parentheses): float32 (the reference, 32); bf16 (16); fp8
E4M3 with one float32 scale per layer and side, ``amax/448`` (8); NVFP4 with the default and
the 4over6 block-scale choice, ``k_scale = amax/448`` per layer and side (4.5: 4-bit codes and
an 8-bit scale per 16 values); int4, symmetric, one fp16 scale (``amax/7``) per token and kv
head (4.25 at head size 64). K and V reach every quantised format as bf16 (what a bf16 model
hands the cache; the store takes bf16/fp16). Global scales come from a calibration batch of
training text (``CALIBRATION_WINDOWS`` windows, never the evaluated text), as a server would
calibrate offline.

Metrics per format: bits per byte (mean -log2 p of the next byte), top-1 accuracy, argmax
agreement with float32 and mean KL(float32 || format) in nats, each with a standard error;
differences to float32 (and between calibrations) are paired (the same windows) and their
standard errors are cluster-robust over files (windows of one file are not independent).

A second table measures calibration choices for NVFP4: the global scale from amax/448 of the
calibration batch per layer (the convention), one scale for all layers, amax/(448*6), and
percentiles; a third, the Hadamard rotation of the head dimension before the store.

Writes ``benchmarks/out/quality_bench.{json,md}``; the tables are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import paged_decode  # noqa: E402
import stdlib_corpus  # noqa: E402
import tiny_lm  # noqa: E402
import train_tiny_lm  # noqa: E402
import jax_nvfp4  # noqa: E402
from jax_nvfp4 import reference  # noqa: E402

CALIBRATION_WINDOWS = 16
CALIBRATION_SEED = 1
EVAL_BATCH = 32
E4M3_MAX = 448.0
#: The real decode path against teacher-forced logits of the same format: |difference in bits
#: per byte| and the share of positions whose argmax differs. Both computations are float32
#: but sum in different orders, and a last-bit difference in K can move a value across a bf16
#: or E2M1 rounding boundary, so they are close, not equal. Measured (RESULTS.md; 4 sequences of
#: 256 steps): at most 0.00011 bits/byte apart, no argmax differing.
DECODE_BOUNDS = dict(bits_per_byte=0.003, argmax_disagreement=0.02)


# --------------------------------------------------------------------------- formats


def to_bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def fp8_round_trip(x, scale):
    """E4M3 with one scale per tensor: saturating at +-448 (a plain cast would give NaN)."""
    y = jnp.clip(to_bf16(x) / scale, -E4M3_MAX, E4M3_MAX)
    return y.astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale


def nvfp4_round_trip(x, scale, scale_search="default"):
    """The store's quantisation (jax_nvfp4.reference: the kernels' bytes) and its read-back,
    value = E2M1 code * E4M3 block scale * global scale (docs/format.md §1)."""
    blocks = to_bf16(x).reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    codes, scale_bytes = reference.quantize_blocks(blocks, scale, scale_search)
    values = reference.e2m1_values(codes) * reference.e4m3_decode(scale_bytes)[..., None]
    return (values * scale).reshape(x.shape)


def int4_round_trip(x):
    """Symmetric int4 (-7..7) with one fp16 scale, amax/7, per head vector (token and head)."""
    xb = to_bf16(x)
    step = (jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / 7).astype(jnp.float16)
    step = step.astype(jnp.float32)
    safe = jnp.where(step > 0, step, 1.0)
    return jnp.clip(jnp.round(xb / safe), -7, 7) * step


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix of size n (a power of two); symmetric, its own
    inverse: the library's rotation (:func:`jax_nvfp4.hadamard_matrix`)."""
    return jax_nvfp4.hadamard_matrix(n)


def rotated(round_trip):
    """A round trip in a rotated basis: x -> round_trip(x H) H. Attention is unchanged by the
    rotation (q H . k H = q . k; the output's rotation is undone by the second H), but values
    outlying in a few coordinates spread across all 16-value blocks."""
    def fn(x, *args):
        h = jnp.asarray(hadamard(x.shape[-1]))
        return round_trip(x @ h, *args) @ h
    return fn


def per_head(round_trip):
    """A round trip with one global scale per kv head: x [..., H, D], scales [H] (simulated:
    the library takes one scale per tensor; each head is quantised as a tensor of its own)."""
    def fn(x, scales):
        return jnp.stack([round_trip(x[..., h, :], scales[h]) for h in range(x.shape[-2])],
                         axis=-2)
    return fn


def per_channel(round_trip):
    """A round trip with power-of-two factors per (kv head, channel) that divide x before the
    store and multiply it after (:func:`jax_nvfp4.channel_factors`' recipe, exact): x [..., H,
    D]; scale [H, D] the global scale times each channel's factor (its minimum is the global
    scale: every head keeps channels of factor 1, and the product is exact)."""
    def fn(x, scale):
        g = jnp.min(scale)
        f = scale / g
        return round_trip(x / f, g) * f
    return fn


#: Round trips by name: (function of (x, scale), needs a global scale, bits per stored value
#: at head size D as a function of D).
ROUND_TRIPS = {
    "float32": (lambda x, s: x, False, lambda d: 32.0),
    "bf16": (lambda x, s: to_bf16(x), False, lambda d: 16.0),
    "fp8": (fp8_round_trip, True, lambda d: 8.0),
    "nvfp4": (nvfp4_round_trip, True, lambda d: 4.5),
    "nvfp4_4over6": (lambda x, s: nvfp4_round_trip(x, s, "4over6"), True, lambda d: 4.5),
    "int4": (lambda x, s: int4_round_trip(x), False, lambda d: 4 + 16 / d),
    "nvfp4_hadamard": (rotated(nvfp4_round_trip), True, lambda d: 4.5),
    "nvfp4_4over6_hadamard": (rotated(lambda x, s: nvfp4_round_trip(x, s, "4over6")), True,
                              lambda d: 4.5),
    # Scales [layers, 2, kv heads] (benchmarks/outlier_bench.py); not in this bench's tables.
    "nvfp4_per_head": (per_head(nvfp4_round_trip), True, lambda d: 4.5),
    "nvfp4_channels": (per_channel(nvfp4_round_trip), True, lambda d: 4.5),
    "nvfp4_4over6_channels": (per_channel(lambda x, s: nvfp4_round_trip(x, s, "4over6")), True,
                              lambda d: 4.5),
}


@dataclasses.dataclass(frozen=True)
class Format:
    """One row: a round trip and how its global scales are calibrated."""
    label: str
    round_trip: str                 # key of ROUND_TRIPS
    calibration: str = "amax/448"   # key of SCALE_RULES (ignored without a global scale)
    per_layer: bool = True          # one scale per layer and side, or one for all layers


MAIN_FORMATS = (
    Format("float32", "float32"),
    Format("bf16", "bf16"),
    Format("fp8 e4m3, per-tensor scale", "fp8"),
    Format("NVFP4 default", "nvfp4"),
    Format("NVFP4 4over6", "nvfp4_4over6"),
    Format("int4, per-token scale", "int4"),
)
CALIBRATION_FORMATS = (
    Format("amax/448, per layer (the convention)", "nvfp4"),
    Format("amax/448, one scale for all layers", "nvfp4", per_layer=False),
    Format("amax/(448*6), per layer", "nvfp4", "amax/(448*6)"),
    Format("amax/(448*6), one scale for all layers", "nvfp4", "amax/(448*6)", per_layer=False),
    Format("p99.9/448, per layer", "nvfp4", "p99.9/448"),
    Format("p99.9/(448*6), per layer", "nvfp4", "p99.9/(448*6)"),
    Format("4over6, amax/(448*6), per layer", "nvfp4_4over6", "amax/(448*6)"),
)
ROTATION_FORMATS = (
    Format("NVFP4 default + Hadamard", "nvfp4_hadamard"),
    Format("NVFP4 4over6 + Hadamard", "nvfp4_4over6_hadamard"),
)

#: Global scale from calibration statistics of |x| (per layer and side).
SCALE_RULES = {
    "amax/448": lambda st: st["amax"] / E4M3_MAX,
    "amax/(448*6)": lambda st: st["amax"] / (E4M3_MAX * 6),
    "p99.9/448": lambda st: st["p99.9"] / E4M3_MAX,
    "p99.9/(448*6)": lambda st: st["p99.9"] / (E4M3_MAX * 6),
}


# --------------------------------------------------------------------------- calibration


def calibration_windows(num=CALIBRATION_WINDOWS, seed=CALIBRATION_SEED, root=None):
    """Windows of training text (never scored): ``num`` x ``EVAL_LENGTH`` bytes at offsets
    drawn from ``seed``."""
    stream = stdlib_corpus.load_split(heldout=False, root=root).stream()
    starts = np.random.default_rng(seed).integers(0, len(stream) - train_tiny_lm.EVAL_LENGTH,
                                                  num)
    return stream[starts[:, None] + np.arange(train_tiny_lm.EVAL_LENGTH)]


def cache_inputs(cfg, params, windows, rotate=False, inject=None):
    """Per layer, (K, V) of the windows as the cache would be given them: K after RoPE, both
    bf16 (as float32 arrays ``[B, T-1, Hkv, D]``), optionally rotated; ``inject(params, layer,
    k, v) -> (k, v)`` (see :func:`make_scorer`) first when given."""
    _, ks, vs = jax.jit(lambda p, t: tiny_lm.forward(cfg, p, t))(
        params, jnp.asarray(windows[:, :-1], jnp.int32))
    out = []
    for i, (k, v) in enumerate(zip(ks, vs)):
        if inject is not None:
            k, v = inject(params, i, k, v)
        layer = []
        for x in (k, v):
            x = to_bf16(x)
            if rotate:
                x = x @ jnp.asarray(hadamard(x.shape[-1]))
            layer.append(np.asarray(x, np.float32))
        out.append(tuple(layer))
    return out


def calibration_stats(cfg, params, windows, rotate=False):
    """Per layer and side (K, V): amax and the 99.9th percentile of |x| over the windows' K
    (after RoPE) and V, as the cache would be given them (bf16), optionally rotated."""
    stats = []
    for layer in cache_inputs(cfg, params, windows, rotate):
        stats.append([{"amax": float(np.abs(x).max()),
                       "p99.9": float(np.percentile(np.abs(x).ravel(), 99.9))} for x in layer])
    return stats


def format_scales(fmt: Format, stats) -> np.ndarray:
    """``[layers, 2]`` float32 global scales (K, V) of a format from calibration statistics."""
    rule = SCALE_RULES[fmt.calibration]
    scales = np.array([[rule(side) for side in layer] for layer in stats], np.float32)
    if not fmt.per_layer:
        scales = np.broadcast_to(scales.max(axis=0), scales.shape).copy()
    return scales


# --------------------------------------------------------------------------- teacher-forced


@functools.cache
def make_scorer(cfg, round_trip: str, inject=None):
    """jit: (params, windows [B, T], scales [layers, 2], float32 log-probs [B, T-1, V]) ->
    per window (bits, correct, agree, kl) sums, and the logits. One per (cfg, round trip,
    inject): a second call returns the same compiled function.

    ``inject(params, layer, k, v) -> (k, v)``, when given, changes each layer's K and V before
    the round trip (e.g. outliers; benchmarks/outlier_bench.py): the model attends to the
    round trip of the changed K and V. It may read entries of ``params`` the model does not
    use (traced arguments: new values do not recompile)."""
    fn = ROUND_TRIPS[round_trip][0]

    def score(params, windows, scales, ref_logp):
        def transform(i, k, v):
            if inject is not None:
                k, v = inject(params, i, k, v)
            return fn(k, scales[i, 0]), fn(v, scales[i, 1])

        logits, _, _ = tiny_lm.forward(cfg, params, windows[:, :-1], kv_transform=transform)
        targets = windows[:, 1:]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        top = jnp.argmax(logits, axis=-1)
        sums = dict(bits=jnp.sum(nll, axis=1) / math.log(2),
                    correct=jnp.sum(top == targets, axis=1),
                    agree=jnp.sum(top == jnp.argmax(ref_logp, axis=-1), axis=1),
                    kl=jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=(1, 2)))
        return sums, logits, logp

    return jax.jit(score)


def teacher_forced(cfg, params, windows, formats, stats, rotated_stats=None, log=print, *,
                   scales_of=None, inject=None):
    """Scores every format on every window. Returns ``{label: {metric: [N] per window}}`` and
    the float32 and per-format logits of the first windows (for the decode check).

    ``scales_of(fmt)``, when given, gives each format's global scales instead of
    :func:`format_scales` of ``stats`` (or ``rotated_stats``); ``inject`` is
    :func:`make_scorer`'s, for every format (float32 included)."""
    windows = np.asarray(windows, np.int32)
    n, t = windows.shape
    batch = min(EVAL_BATCH, n)
    padded = -(-n // batch) * batch                      # one shape: one compile per round trip
    win = np.zeros((padded, t), np.int32)
    win[:n] = windows
    scorers, results = {}, {}
    ref_logp = np.zeros((padded, t - 1, cfg.vocab), np.float32)
    order = sorted(formats, key=lambda f: f.round_trip != "float32")   # float32 first
    for fmt in order:
        has_scale = ROUND_TRIPS[fmt.round_trip][1]
        use = rotated_stats if "hadamard" in fmt.round_trip else stats
        if not has_scale:
            scales = np.ones((cfg.layers, 2), np.float32)
        else:
            scales = scales_of(fmt) if scales_of is not None else format_scales(fmt, use)
        if fmt.round_trip not in scorers:
            scorers[fmt.round_trip] = make_scorer(cfg, fmt.round_trip, inject)
        t0 = time.perf_counter()
        sums = {k: [] for k in ("bits", "correct", "agree", "kl")}
        for i in range(0, padded, batch):
            out, _, logp = scorers[fmt.round_trip](params, jnp.asarray(win[i:i + batch]),
                                                   jnp.asarray(scales),
                                                   jnp.asarray(ref_logp[i:i + batch]))
            if fmt.round_trip == "float32":
                ref_logp[i:i + batch] = np.asarray(logp)
                out = dict(out, agree=jnp.full(out["agree"].shape, t - 1), kl=out["kl"] * 0)
            for k in sums:
                sums[k].append(np.asarray(out[k], np.float64))
        results[fmt.label] = {k: np.concatenate(v)[:n] for k, v in sums.items()}
        results[fmt.label]["scales"] = scales.tolist() if has_scale else None
        log(f"  {fmt.label}: {results[fmt.label]['bits'].sum() / (n * (t - 1)):.4f} bits/byte "
            f"({time.perf_counter() - t0:.1f} s)")
    return results


# --------------------------------------------------------------------------- statistics


def cluster_mean(values, counts, owners):
    """Ratio mean sum(values)/sum(counts) and its standard error, clustered by owner (file)."""
    values, counts = np.asarray(values, np.float64), np.asarray(counts, np.float64)
    files = np.unique(owners)
    v = np.array([values[owners == f].sum() for f in files])
    c = np.array([counts[owners == f].sum() for f in files])
    mean = v.sum() / c.sum()
    k = len(files)
    se = math.sqrt(k / max(k - 1, 1) * np.sum((v - mean * c) ** 2)) / c.sum()
    return mean, se


def summarise(results, owners, positions: int, baseline="float32"):
    """Per format: bits/byte, top-1 accuracy, agreement, KL (each with its SE) and the paired
    difference in bits/byte to ``baseline``."""
    n = len(owners)
    counts = np.full(n, positions, np.float64)
    base = results[baseline]["bits"]
    table = {}
    for label, r in results.items():
        row = {}
        for name, key in (("bits_per_byte", "bits"), ("top1", "correct"),
                          ("argmax_agreement", "agree"), ("kl_nats", "kl")):
            row[name], row[name + "_se"] = cluster_mean(r[key], counts, owners)
        row["delta_bits_per_byte"], row["delta_se"] = cluster_mean(r["bits"] - base, counts,
                                                                   owners)
        row["scales"] = r["scales"]
        table[label] = row
    return table


def paired_delta(results, owners, positions, a, b):
    """bits/byte of format a minus format b on the same windows, with its clustered SE."""
    counts = np.full(len(owners), positions, np.float64)
    return cluster_mean(results[a]["bits"] - results[b]["bits"], counts, owners)


# --------------------------------------------------------------------------- decode path


def decode_path_logits(cfg, params, windows, kind, scales=None, scale_search="default"):
    """Logits of every position of each window through examples/paged_decode.py's decode step:
    one token per step from position 0, stored into a paged cache (``jax_nvfp4.reshape_and_cache``
    or the bf16 twin) and attended to with ``jax_nvfp4.paged_attention`` (or
    ``paged_attention_bf16``). Returns ``[B, T-1, vocab]`` float32."""
    windows = np.asarray(windows, np.int32)
    batch, length = windows.shape[0], windows.shape[1] - 1
    fields = dataclasses.asdict(tiny_lm.model_config(cfg))
    pcfg = paged_decode.Config(batch=batch, steps=length, scale_search=scale_search,
                               progress=False, report=False, **fields)
    pages = -(-length // pcfg.block_size)
    num_blocks = batch * pages
    alloc = paged_decode.BlockAllocator(num_blocks, pcfg.block_size, pages, seed=0)
    seqs = list(range(batch))
    for s in seqs:
        alloc.add_sequence(s)
    caches = paged_decode.allocate_caches(pcfg, kind, num_blocks)
    step = paged_decode.make_decode_step(pcfg, kind, {kind: 0})
    if kind == "nvfp4":
        step_scales = tuple((jnp.float32(k), jnp.float32(v)) for k, v in scales)
    else:
        step_scales = tuple(() for _ in range(cfg.layers))
    for s in seqs:
        alloc.append_slots(s, length)                   # every step's page, reserved up front
    tables = jnp.asarray(alloc.block_tables(seqs))
    seq_lens = jnp.ones(batch, jnp.int32)               # step i stores position i
    out = []
    for i in range(length):
        (caches, seq_lens), (_, logits) = step(params, caches, step_scales,
                                               jnp.asarray(windows[:, i]), tables, seq_lens)
        out.append(logits)
    return np.stack([np.asarray(x) for x in out], axis=1)


#: The decode-path checks: label -> (paged_decode cache kind, round trip, scale_search).
DECODE_CHECKS = {"bf16": ("bf16", "bf16", "default"),
                 "NVFP4 default": ("nvfp4", "nvfp4", "default"),
                 "NVFP4 4over6": ("nvfp4", "nvfp4_4over6", "4over6")}


def decode_check(cfg, params, windows, stats, labels=tuple(DECODE_CHECKS), log=print):
    """The real decode path against the teacher-forced round trip on the same windows (by
    default for bf16 and both NVFP4 block-scale choices). Returns a row per format."""
    rows = {}
    targets = np.asarray(windows[:, 1:], np.int64)
    for label in labels:
        kind, round_trip, search = DECODE_CHECKS[label]
        t0 = time.perf_counter()
        fmt = Format(label, round_trip)
        scales = format_scales(fmt, stats) if kind == "nvfp4" else np.ones((cfg.layers, 2))
        _, tf_logits, _ = make_scorer(cfg, round_trip)(
            params, jnp.asarray(windows, jnp.int32), jnp.asarray(scales, jnp.float32),
            jnp.zeros(targets.shape + (cfg.vocab,), jnp.float32))
        tf_logits = np.asarray(tf_logits)
        dec_logits = decode_path_logits(cfg, params, windows, kind, scales, search)

        def bpb(logits):
            lp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            return -np.take_along_axis(lp, targets[..., None], -1).mean() / math.log(2)

        kl = paged_decode._kl(tf_logits, dec_logits)
        rows[label] = dict(
            teacher_forced_bits_per_byte=float(bpb(tf_logits)),
            decode_bits_per_byte=float(bpb(dec_logits)),
            argmax_disagreement=float((tf_logits.argmax(-1) != dec_logits.argmax(-1)).mean()),
            max_abs_logit_diff=float(np.abs(tf_logits - dec_logits).max()),
            mean_kl_nats=float(kl.mean()))
        r = rows[label]
        r["bits_per_byte_diff"] = r["decode_bits_per_byte"] - r["teacher_forced_bits_per_byte"]
        r["within_bounds"] = bool(abs(r["bits_per_byte_diff"]) <= DECODE_BOUNDS["bits_per_byte"]
                                  and r["argmax_disagreement"]
                                  <= DECODE_BOUNDS["argmax_disagreement"])
        log(f"  {label}: decode {r['decode_bits_per_byte']:.4f} vs teacher-forced "
            f"{r['teacher_forced_bits_per_byte']:.4f} bits/byte ({time.perf_counter() - t0:.1f} s)")
    return rows


# --------------------------------------------------------------------------- tables


def _pct(x, se):
    return f"{100 * x:.2f}% ± {100 * se:.2f}"


def main_table(summary, formats, bits_per_value):
    lines = ["| KV cache | bits/value | bits/byte | Δ vs float32 (± SE) | top-1 accuracy | "
             "argmax agreement with float32 (± SE) | mean KL vs float32, nats (± SE) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for fmt in formats:
        r = summary[fmt.label]
        lines.append(f"| {fmt.label} | {bits_per_value[fmt.label]:g} | "
                     f"{r['bits_per_byte']:.4f} | {r['delta_bits_per_byte']:+.4f} ± "
                     f"{r['delta_se']:.4f} | {100 * r['top1']:.2f}% | "
                     f"{_pct(r['argmax_agreement'], r['argmax_agreement_se'])} | "
                     f"{r['kl_nats']:.2g} ± {r['kl_nats_se']:.1g} |")
    return "\n".join(lines)


def comparison_table(summary, formats, versus, deltas):
    lines = [f"| NVFP4 calibration | bits/byte | Δ vs float32 | Δ vs {versus} (± SE) | "
             f"argmax agreement | mean KL, nats |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for fmt in formats:
        r = summary[fmt.label]
        d, se = deltas[fmt.label]
        lines.append(f"| {fmt.label} | {r['bits_per_byte']:.4f} | "
                     f"{r['delta_bits_per_byte']:+.4f} | {d:+.4f} ± {se:.4f} | "
                     f"{100 * r['argmax_agreement']:.2f}% | {r['kl_nats']:.2g} |")
    return "\n".join(lines)


def decode_table(rows):
    lines = ["| KV cache | teacher-forced bits/byte | decode path bits/byte | difference | "
             "argmax differs | max abs logit diff | mean KL, nats | within bounds |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['teacher_forced_bits_per_byte']:.4f} | "
                     f"{r['decode_bits_per_byte']:.4f} | {r['bits_per_byte_diff']:+.5f} | "
                     f"{100 * r['argmax_disagreement']:.2f}% | {r['max_abs_logit_diff']:.3g} | "
                     f"{r['mean_kl_nats']:.2g} | {'yes' if r['within_bounds'] else 'NO'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- driver


def run(*args, **kwargs):
    """Runs everything; returns a results dict (tables as Markdown under ``markdown``).

    float32 matrix products at full float32 precision: on a GPU XLA's default lets them run in
    TF32, which moved the model's own loss (H200, 2026-11-30, 4 held-out windows of 65 bytes,
    teacher-forced with an NVFP4 cache: 2.6562 bits/byte in TF32, 2.6611 in float32, 2.6605
    on the CPU) and with it every row of the tables. On the CPU this changes nothing."""
    with jax.default_matmul_precision("highest"):
        return _run(*args, **kwargs)


def _run(windows_per_file=train_tiny_lm.EVAL_WINDOWS_PER_FILE, decode_sequences=4,
         decode_length=train_tiny_lm.EVAL_LENGTH, file_stride=1, formats=None,
         decode_labels=tuple(DECODE_CHECKS), log=print):
    t_start = time.perf_counter()
    cfg, params, meta = tiny_lm.load_weights()
    split = stdlib_corpus.load_split(heldout=True)
    all_windows, all_owners = stdlib_corpus.heldout_windows(split, train_tiny_lm.EVAL_LENGTH,
                                                            windows_per_file)
    keep = np.isin(all_owners, np.unique(all_owners)[::file_stride])
    windows, owners = all_windows[keep], all_owners[keep]
    positions = windows.shape[1] - 1
    log(f"model: {tiny_lm.TRAINED_WEIGHTS.name} ({tiny_lm.num_params(params):,} parameters, "
        f"trained on Python {meta['python']}); held-out: {len(windows)} windows of "
        f"{windows.shape[1]} bytes from {len(np.unique(owners))} files (Python "
        f"{stdlib_corpus.python_version()}, {split.root})")
    if formats is None:
        formats = MAIN_FORMATS + CALIBRATION_FORMATS[1:] + ROTATION_FORMATS
    calib = calibration_windows()
    stats = calibration_stats(cfg, params, calib)
    rotated_stats = (calibration_stats(cfg, params, calib, rotate=True)
                     if any("hadamard" in f.round_trip for f in formats) else None)

    log("teacher-forced:")
    results = teacher_forced(cfg, params, windows, formats, stats, rotated_stats, log=log)
    summary = summarise(results, owners, positions)
    labels = {f.label for f in formats}
    # The convention's row of the calibration table is the main table's NVFP4 default.
    convention = CALIBRATION_FORMATS[0]
    if "NVFP4 default" in results:
        summary[convention.label] = summary["NVFP4 default"]
        results[convention.label] = results["NVFP4 default"]
    bits_per_value = {f.label: ROUND_TRIPS[f.round_trip][2](cfg.head_size) for f in formats}

    out = dict(date=datetime.date.today().isoformat(), python=stdlib_corpus.python_version(),
               jax=jax.__version__, backend=jax.default_backend(), model_meta=meta,
               windows=len(windows), files=int(len(np.unique(owners))), positions=positions,
               calibration=dict(windows=CALIBRATION_WINDOWS, seed=CALIBRATION_SEED, stats=stats,
                                rotated_stats=rotated_stats),
               summary=summary)
    md = []
    main = [f for f in MAIN_FORMATS if f.label in labels]
    md.append(main_table(summary, main, bits_per_value))
    if "NVFP4 default" in results:
        cal = [f for f in CALIBRATION_FORMATS if f.label in summary]
        # Each against the convention with the same block-scale choice.
        same_search = {"nvfp4": "NVFP4 default", "nvfp4_4over6": "NVFP4 4over6"}
        deltas = {f.label: paired_delta(results, owners, positions, f.label,
                                        same_search[f.round_trip])
                  for f in cal if same_search[f.round_trip] in results}
        cal = [f for f in cal if f.label in deltas]
        md.append(comparison_table(summary, cal, "amax/448 per layer, same block scales",
                                   deltas))
        rot = [f for f in ROTATION_FORMATS if f.label in labels]
        if rot:
            deltas = {f.label: paired_delta(results, owners, positions, f.label,
                                            "NVFP4 default") for f in rot}
            deltas.update({"NVFP4 4over6 + Hadamard": paired_delta(
                results, owners, positions, "NVFP4 4over6 + Hadamard", "NVFP4 4over6")}
                if "NVFP4 4over6 + Hadamard" in labels and "NVFP4 4over6" in labels else {})
            md.append(comparison_table(summary, rot, "the same without rotation", deltas)
                      .replace("NVFP4 calibration", "rotation"))
        out["deltas_vs_nvfp4_default"] = {
            label: paired_delta(results, owners, positions, label, "NVFP4 default")
            for label in results}
        if "bf16" in results:
            out["nvfp4_minus_bf16"] = paired_delta(results, owners, positions,
                                                   "NVFP4 default", "bf16")
    if decode_sequences:
        # Windows from different files, spread over the held-out split.
        first = np.unique(owners, return_index=True)[1]
        pick = first[np.linspace(0, len(first) - 1, decode_sequences).astype(int)]
        log(f"decode path ({decode_sequences} sequences of {decode_length - 1} steps):")
        rows = decode_check(cfg, params, windows[pick, :decode_length], stats, decode_labels,
                            log=log)
        out["decode_check"] = rows
        md.append(decode_table(rows))
    out["markdown"] = md
    out["wall_s"] = time.perf_counter() - t_start
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one window from every 8th held-out file, the main table, "
                        "2 decodes of 32 steps")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "out")
    a = p.parse_args(argv)
    if a.quick:
        result = run(windows_per_file=1, file_stride=8, decode_sequences=2, decode_length=33,
                     formats=MAIN_FORMATS)
    else:
        result = run()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "quality_bench.json").write_text(json.dumps(
        {k: v for k, v in result.items() if k != "markdown"}, indent=1, default=float))
    text = "\n\n".join(result["markdown"])
    (a.out / "quality_bench.md").write_text(text + "\n")
    if "nvfp4_minus_bf16" in result:
        d, se = result["nvfp4_minus_bf16"]
        print(f"NVFP4 default - bf16: {d:+.4f} ± {se:.4f} bits/byte (paired, clustered by file)")
    print(f"wall time {result['wall_s']:.0f} s; wrote {a.out}/quality_bench.{{json,md}}\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
