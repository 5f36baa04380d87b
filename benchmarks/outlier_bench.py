"""What token and channel outliers cost an NVFP4 KV cache, and which remedy removes the cost.

    python benchmarks/outlier_bench.py           # the full tables: 6 to 9 minutes on 2 CPU cores
    python benchmarks/outlier_bench.py --quick   # a smoke run (20 s): small sizes, one window every 20 files

An NVFP4 value is an E2M1 code (magnitudes 0, 0.5, ..., 6) times an E4M3 block scale (one per 16
values, largest 448, smallest normal 2**-6, subnormals down to 2**-9) times one float32 global
scale per tensor and side (``k_scale``/``v_scale``). Two kinds of outlier hurt it differently:
a *token* outlier (one position far larger than the rest: an attention sink) sets the global
scale, so every ordinary block's scale falls towards and below E4M3's normal range, and at
1e5 times the rest to zero; a *channel* outlier (one coordinate of every head vector far larger)
sets the block scale of its 16-value block, whose other 15 values are rounded on that scale,
mostly to the codes 0 and 0.5.

"Headroom" h names a global scale: ``scale = h * amax / (6 * 448)``, so that the largest
magnitude the cache holds, ``6 * 448 * scale``, is h times the calibration amax. Headroom 6 is
today's ``amax/448`` (jax_nvfp4.scale_from_amax: vLLM's and FlashInfer's convention), headroom 1
is ``amax/(448*6)``, headroom 3 is ``amax/(448*2)``, headroom 2 ``amax/(448*3)``.

**Synthetic tensors** (K and V separately, each ``[512 tokens, 8 kv heads, 128]``, standard
Gaussian, fixed seeds, bf16 as the store takes them): Gaussian; position 0 times 1e2..1e5; one
channel per head (a fixed random one) times 10, 100, 1000; position 0 times 1e4 and the
channels times 100 at the other positions together (not compounded: position 0's channel value
is not 1e6 times the rest); and, added to answer whether per-head scales are worth building,
position 0 times 1e4 in kv head 0 only. Methods: fp8 E4M3 per tensor (amax/448, saturating);
NVFP4 at headroom 6, 3, 2 and 1; 4over6 block scales (``scale_search="4over6"``) at headroom 6
and 1; one global scale per kv head from that head's amax (simulated: the library takes one
per tensor, so each head is quantised as a tensor of its own), headroom 6 and 1; a Hadamard
rotation of the head dimension (rotate, store, read, rotate back; the global scale from the
rotated tensor's amax), headroom 6 and 1; power-of-two channel factors
(:func:`jax_nvfp4.channel_factors` of the tensor's own channel amaxes: ``x / f`` stored, ``f``
times it read back), headroom 6 and 1 and 4over6 at headroom 1. The NVFP4 values are the library's bytes
(:func:`jax_nvfp4.reference.quantize_blocks` through quality_bench's round trips); every NVFP4
row is also stored with ``jax_nvfp4.reshape_and_cache`` (K and V in one store; per head and
rotated alike) and read back with ``jax_nvfp4.dequantize``, and the two must agree bit for bit
(the run fails otherwise). Metrics: the relative L2 error of the ordinary values (all but the
outlier token and channels), the outliers' own relative L2 error, and the share of the ordinary
nonzero values stored as zero.

**The trained model** (quality_bench's: examples/tiny_lm.npz, 4 layers, 2 kv heads of 64, RoPE)
scores held-out windows (one from the middle of each held-out file: 77) teacher-forced as
quality_bench's main table does (the K and V of every position, in every layer, round-trip
through the format before attention), with outliers put
into K and V as the cache is given them, and the float32 reference computed with the same
outliers, so each row measures what the format loses, not what the injection does. An outlier
must leave the float32 model meaningful, so each is put where float32 attention cannot see it:

* *channel outliers*: in every layer and kv head the RoPE pair of K channels (c, c + 32) with
  the largest calibration |K| (2 of 64 channels, in 2 of the 4 blocks) is multiplied by g (10,
  100, 1000; in ``wk``'s columns) and the same channels of the group's queries are divided by g
  (``wq``'s columns): ``q.k`` is unchanged (RoPE rotates within the pair, so it commutes with
  scaling it). This is how real channel outliers are harmless in float and hurt a cache.
* *a sink token*: at position 0 of every window, one K channel and one V channel of every kv
  head are set to g times that layer's and head's largest calibration |K| (|V|) (g = 1e2..1e5:
  the token's amax becomes g times the rest, as in the synthetic token rows). The float32 model
  cannot see them: the K channel is one of a RoPE pair that the group's queries have set to zero
  (``wq``'s columns of the pair with the smallest norm), the V channel one that the output
  projection ignores (``wo``'s rows of the channel with the smallest norm, for the group's query
  heads, set to zero). Multiplying the sink's whole K by 1e5 would instead make every query
  attend only to it in float32 as well, and its whole V by 1e5 would swamp every output: the
  reference would no longer be a language model. Since zeroing those weights changes the model
  a little, every case (including "none") uses the changed model; its float32 cost against the
  shipped weights is measured and printed. What this sink tests: the shared global scale (every
  ordinary token's fidelity) and the sink's other channels, not the fidelity of the large value
  itself (the model cannot see that value by construction). Unlike the synthetic token, it is
  one large coordinate per head, not a whole large vector: a Hadamard rotation spreads it over
  the sink's other coordinates (and divides it by sqrt(64)).

Global scales are calibrated per layer and side on quality_bench's calibration windows (training
text) with the same outliers, as a server would calibrate on its own data. Formats: float32 (the
reference), fp8 per tensor, NVFP4 headroom 6 (default) and 1, 4over6 at headroom 6 and 1,
per-kv-head scales at headroom 6 and 1, Hadamard at headroom 6 and 1, channel factors
(:func:`jax_nvfp4.channel_factors` of the calibration's per-channel amax) at headroom 6 and 1 and
with 4over6 at headroom 1. Metrics: quality_bench's
(bits/byte, KL(float32 || format), argmax agreement with float32; standard errors clustered by
file; differences paired on the same windows). Also printed: the held-out K and V's largest
magnitude over the calibration amax (above 1, headroom 1 clips those values).

Writes ``benchmarks/out/outlier_bench.{json,md}``; the tables are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import quality_bench as qb  # noqa: E402
import jax_nvfp4  # noqa: E402

E4M3_MAX = qb.E4M3_MAX
#: Synthetic tensors: tokens, kv heads, head size; K and V's seeds; the outlier channels' seed.
SYN_SHAPE = (512, 8, 128)
SYN_SEEDS = {"K": 0, "V": 1}
CHANNEL_SEED = 2
BLOCK_SIZE = 16                      # page size of the store-path check's cache
#: The full run's held-out windows: one per file, from its middle (the second of two spread
#: over it, as stdlib_corpus.heldout_windows spreads them; a file too short for two gives its
#: first): 77 windows on Python 3.11.7. Files' starts (licence headers, imports) are atypical.
WINDOWS_PER_FILE = 2


def headroom_divisor(headroom):
    """NVFP4 global scale = amax / divisor: 6 * 448 * scale = headroom * amax."""
    return E4M3_MAX * 6 / headroom


# --------------------------------------------------------------------------- synthetic tensors


@dataclasses.dataclass(frozen=True)
class Case:
    """Outliers: position 0 times ``token`` and one channel (a synthetic tensor's) or K channel
    pair (the model's) per head times ``channel``, 1 meaning none; ``token_heads`` limits the
    token outlier to those heads (synthetic only). In the model the token outlier is the sink
    of :func:`case_params`."""
    label: str
    token: float = 1.0
    channel: float = 1.0
    token_heads: tuple | None = None


def outlier_cases(token_name, channel_name, none_name):
    """Both tables' cases: none, the token alone at 1e2..1e5, the channels alone at 10..1000,
    and both (1e4 and 100)."""
    return ((Case(none_name),)
            + tuple(Case(f"{token_name} x{g:.0e}".replace("e+0", "e"), token=g)
                    for g in (1e2, 1e3, 1e4, 1e5))
            + tuple(Case(f"{channel_name} x{g}", channel=g) for g in (10, 100, 1000))
            + (Case(f"{token_name} x1e4 + channels x100", token=1e4, channel=100),))


SYN_CASES = outlier_cases("token", "channel", "Gaussian") + (
    Case("token x1e4 in kv head 0 only", token=1e4, token_heads=(0,)),)


@dataclasses.dataclass(frozen=True)
class Method:
    """A synthetic-table column: a quality_bench round trip and the global scale's divisor of
    amax (of the tensor, of each head, or of the rotated tensor)."""
    label: str
    round_trip: str                  # key of quality_bench.ROUND_TRIPS
    divisor: float
    scale_search: str = "default"

    @property
    def per_head(self):
        return self.round_trip.endswith("per_head")

    @property
    def rotated(self):
        return "hadamard" in self.round_trip

    @property
    def channels(self):
        return self.round_trip.endswith("channels")


SYN_METHODS = (
    Method("fp8", "fp8", E4M3_MAX),
    Method("h6 (default)", "nvfp4", headroom_divisor(6)),
    Method("h3", "nvfp4", headroom_divisor(3)),
    Method("h2", "nvfp4", headroom_divisor(2)),
    Method("h1", "nvfp4", headroom_divisor(1)),
    Method("4o6 h6", "nvfp4_4over6", headroom_divisor(6), "4over6"),
    Method("4o6 h1", "nvfp4_4over6", headroom_divisor(1), "4over6"),
    Method("head h6", "nvfp4_per_head", headroom_divisor(6)),
    Method("head h1", "nvfp4_per_head", headroom_divisor(1)),
    Method("Had h6", "nvfp4_hadamard", headroom_divisor(6)),
    Method("Had h1", "nvfp4_hadamard", headroom_divisor(1)),
    Method("chan h6", "nvfp4_channels", headroom_divisor(6)),
    Method("chan h1", "nvfp4_channels", headroom_divisor(1)),
    Method("4o6 chan h1", "nvfp4_4over6_channels", headroom_divisor(1), "4over6"),
)
SYN_LEGEND = ("fp8: E4M3 per tensor, amax/448. h6 (default): NVFP4 amax/448 (today's "
              "scale_from_amax); h3: amax/(448*2); h2: amax/(448*3); h1: amax/(448*6). 4o6: "
              "4over6 block scales. head: one global scale per kv head. Had: Hadamard rotation "
              "of the head dimension (scale from the rotated tensor's amax). chan: "
              "jax_nvfp4.channel_factors from the tensor's own channel amaxes, x / f stored, "
              "f x read back (scale from x / f's amax).")


def synthetic_tensor(case, side, shape=SYN_SHAPE):
    """(x [T, H, D] float32 holding bf16 values, outlier mask [T, H, D] bool)."""
    tokens, heads, dim = shape
    x = np.random.default_rng(SYN_SEEDS[side]).standard_normal(shape).astype(np.float32)
    mask = np.zeros(shape, bool)
    if case.token != 1:
        heads_hit = list(range(heads)) if case.token_heads is None else list(case.token_heads)
        x[0, heads_hit] *= np.float32(case.token)
        mask[0, heads_hit] = True
    if case.channel != 1:
        # Not compounded with a token outlier: its position keeps its own factor.
        rows = np.arange(1 if case.token != 1 else 0, tokens)[:, None]
        channels = np.random.default_rng(CHANNEL_SEED).integers(0, dim, heads)
        x[rows, np.arange(heads), channels] *= np.float32(case.channel)
        mask[rows, np.arange(heads), channels] = True
    return np.asarray(qb.to_bf16(jnp.asarray(x))), mask


def method_scale(method, x):
    """The method's global scale(s) for x [T, H, D]: float32 scalar, or [H] per head."""
    if method.rotated:
        x = np.asarray(qb.to_bf16(jnp.asarray(x) @ jnp.asarray(qb.hadamard(x.shape[-1]))))
    if method.channels:                  # the global scale times each channel's factor [H, D]
        f = np.asarray(jax_nvfp4.channel_factors(np.abs(x).max(axis=0)))
        return (np.abs(x / f).max() / np.float32(method.divisor) * f).astype(np.float32)
    a = np.abs(x)
    amax = a.max(axis=(0, 2)) if method.per_head else a.max()
    return (amax / np.float32(method.divisor)).astype(np.float32)


_JITTED = {}


def round_trip(method, x, scale):
    fn = _JITTED.setdefault(method.round_trip, jax.jit(qb.ROUND_TRIPS[method.round_trip][0]))
    return np.asarray(fn(jnp.asarray(x), jnp.asarray(scale)))


def store_path(method, k, v, k_scale, v_scale):
    """The same K and V through the library's store and reader: jax_nvfp4.reshape_and_cache
    into a paged cache, jax_nvfp4.dequantize (float32) back; per head as one-head caches,
    rotated as the rotated tensors. Returns (k, v) [T, H, D]."""
    tokens, heads, dim = k.shape
    if method.rotated:
        h = jnp.asarray(qb.hadamard(dim))
        k_rt, v_rt = store_path(dataclasses.replace(method, round_trip="nvfp4"),
                                np.asarray(jnp.asarray(k) @ h), np.asarray(jnp.asarray(v) @ h),
                                k_scale, v_scale)
        return np.asarray(jnp.asarray(k_rt) @ h), np.asarray(jnp.asarray(v_rt) @ h)
    if method.channels:                  # x / f stored with the global scale, f x read back
        f_k, f_v = (np.asarray(s) / np.min(s) for s in (k_scale, v_scale))
        plain = dataclasses.replace(method, round_trip="nvfp4")
        k_rt, v_rt = store_path(plain, k / f_k, v / f_v, np.min(k_scale), np.min(v_scale))
        return k_rt * f_k, v_rt * f_v
    if method.per_head:
        one = dataclasses.replace(method, round_trip="nvfp4")
        parts = [store_path(one, k[:, i:i + 1], v[:, i:i + 1], k_scale[i], v_scale[i])
                 for i in range(heads)]
        return tuple(np.concatenate([p[s] for p in parts], axis=1) for s in (0, 1))
    cache = jax_nvfp4.allocate_kv_cache(tokens // BLOCK_SIZE, BLOCK_SIZE, heads, dim)
    cache = jax_nvfp4.reshape_and_cache(
        jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), cache,
        jnp.arange(tokens, dtype=jnp.int32), k_scale, v_scale, scale_search=method.scale_search)
    k_out, v_out = jax_nvfp4.dequantize(cache, k_scale, v_scale, dtype=jnp.float32)
    return (np.asarray(k_out).reshape(tokens, heads, dim),
            np.asarray(v_out).reshape(tokens, heads, dim))


def _rel_l2(x, xhat):
    x, xhat = x.astype(np.float64), xhat.astype(np.float64)
    return float(np.linalg.norm(xhat - x) / np.linalg.norm(x))


def tensor_metrics(x, xhat, mask):
    """Ordinary values' relative L2 error, the outliers' (None without outliers), and the share
    of ordinary nonzero values stored as zero."""
    ordinary = ~mask
    nonzero = ordinary & (x != 0)
    return dict(ordinary_error=_rel_l2(x[ordinary], xhat[ordinary]),
                outlier_error=_rel_l2(x[mask], xhat[mask]) if mask.any() else None,
                ordinary_zero_share=float(np.mean(xhat[nonzero] == 0)))


def synthetic(cases=SYN_CASES, methods=SYN_METHODS, shape=SYN_SHAPE, log=print):
    """``{side: {case: {method: metrics}}}`` and the largest |round trip - store path| over
    every NVFP4 cell (must be 0)."""
    table = {side: {} for side in SYN_SEEDS}
    worst = 0.0
    for case in cases:
        t0 = time.perf_counter()
        data = {side: synthetic_tensor(case, side, shape) for side in SYN_SEEDS}
        for side in SYN_SEEDS:
            table[side][case.label] = {}
        for method in methods:
            scales = {side: method_scale(method, data[side][0]) for side in SYN_SEEDS}
            out = {side: round_trip(method, data[side][0], scales[side]) for side in SYN_SEEDS}
            if method.round_trip != "fp8":
                stored = store_path(method, data["K"][0], data["V"][0], scales["K"], scales["V"])
                for side, s in zip(SYN_SEEDS, stored):
                    worst = max(worst, float(np.max(np.abs(s - out[side]))))
            for side in SYN_SEEDS:
                x, mask = data[side]
                table[side][case.label][method.label] = tensor_metrics(x, out[side], mask)
        log(f"  {case.label} ({time.perf_counter() - t0:.1f} s)")
    return table, worst


def _num(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def synthetic_tables(table, cases, methods, shape):
    """Markdown: per side, the three metrics as case x method matrices."""
    head = "| case | " + " | ".join(m.label for m in methods) + " |"
    rule = "| --- |" + " ---: |" * len(methods)
    metrics = (("ordinary_error", "relative L2 error of the ordinary values",
                lambda x: _num(x)),
               ("outlier_error", "relative L2 error of the outlier values",
                lambda x: _num(x)),
               ("ordinary_zero_share", "share of ordinary nonzero values stored as zero",
                lambda x: f"{100 * x:.1f}%"))
    out = []
    for side in table:
        for key, title, fmt in metrics:
            lines = [f"**{side}, {shape[0]} tokens x {shape[1]} kv heads x {shape[2]}: "
                     f"{title}**", "", head, rule]
            for case in cases:
                row = table[side][case.label]
                cells = [fmt(row[m.label][key]) for m in methods]
                if key == "outlier_error" and all(c == "-" for c in cells):
                    continue
                lines.append(f"| {case.label} | " + " | ".join(cells) + " |")
            out.append("\n".join(lines))
    return out


# --------------------------------------------------------------------------- the trained model


MODEL_CASES = outlier_cases("sink", "K channels", "none")

F = qb.Format
MODEL_FORMATS = (
    F("float32", "float32"),
    F("fp8 e4m3, per-tensor scale", "fp8"),
    F("NVFP4 default (headroom 6)", "nvfp4"),
    F("NVFP4 headroom 1", "nvfp4", "amax/(448*6)"),
    F("NVFP4 4over6 (headroom 6)", "nvfp4_4over6"),
    F("NVFP4 4over6, headroom 1", "nvfp4_4over6", "amax/(448*6)"),
    F("NVFP4 per-kv-head scales, headroom 6", "nvfp4_per_head"),
    F("NVFP4 per-kv-head scales, headroom 1", "nvfp4_per_head", "amax/(448*6)"),
    F("NVFP4 + Hadamard, headroom 6", "nvfp4_hadamard"),
    F("NVFP4 + Hadamard, headroom 1", "nvfp4_hadamard", "amax/(448*6)"),
    F("NVFP4 channel factors, headroom 6", "nvfp4_channels"),
    F("NVFP4 channel factors, headroom 1", "nvfp4_channels", "amax/(448*6)"),
    F("NVFP4 4over6 + channel factors, headroom 1", "nvfp4_4over6_channels", "amax/(448*6)"),
)
#: Paired comparisons: (remedy, against).
COMPARISONS = (
    ("NVFP4 headroom 1", "NVFP4 default (headroom 6)"),
    ("NVFP4 4over6, headroom 1", "NVFP4 4over6 (headroom 6)"),
    ("NVFP4 per-kv-head scales, headroom 6", "NVFP4 default (headroom 6)"),
    ("NVFP4 per-kv-head scales, headroom 1", "NVFP4 headroom 1"),
    ("NVFP4 + Hadamard, headroom 6", "NVFP4 default (headroom 6)"),
    ("NVFP4 + Hadamard, headroom 1", "NVFP4 headroom 1"),
    ("NVFP4 channel factors, headroom 6", "NVFP4 default (headroom 6)"),
    ("NVFP4 channel factors, headroom 1", "NVFP4 headroom 1"),
    ("NVFP4 4over6 + channel factors, headroom 1", "NVFP4 4over6, headroom 1"),
)


def inject_sink(params, layer, k, v):
    """quality_bench's ``inject``: position 0's K and V channels ``params["outliers"]``
    names (one per kv head) set to its values (where they are > 0)."""
    o = params["outliers"]
    out = []
    for x, value, channel in ((k, o["sink_k"][layer], o["k_channel"][layer]),
                              (v, o["sink_v"][layer], o["v_channel"][layer])):
        hit = jax.nn.one_hot(channel, x.shape[-1], dtype=jnp.bool_) & (value > 0)[:, None]
        first = jnp.where(hit, value[:, None].astype(x.dtype), x[:, 0])      # [B, H, D]
        out.append(x.at[:, 0].set(first))
    return tuple(out)


def model_channels(cfg, params, calib_inputs):
    """Per layer and kv head: the K channel pair the queries are made blind to (smallest
    ``wq`` column norm over the group), the V channel ``wo`` is made blind to (smallest row
    norm), the K pair made an outlier (largest calibration |K|, the blind pair excluded), and
    the calibration amax of K and V (before any outlier)."""
    d, half = cfg.head_size, cfg.head_size // 2
    group = cfg.num_q_heads // cfg.num_kv_heads
    out = {key: np.zeros((cfg.layers, cfg.num_kv_heads), np.int32)
           for key in ("k_blind_pair", "v_blind_channel", "k_outlier_pair")}
    out["k_amax"] = np.zeros((cfg.layers, cfg.num_kv_heads), np.float32)
    out["v_amax"] = np.zeros((cfg.layers, cfg.num_kv_heads), np.float32)
    for i, layer in enumerate(params["layers"]):
        wq = np.asarray(layer["wq"]).reshape(cfg.d_model, cfg.num_q_heads, d)
        wo = np.asarray(layer["wo"]).reshape(cfg.num_q_heads, d, cfg.d_model)
        k, v = calib_inputs[i]
        for h in range(cfg.num_kv_heads):
            q_heads = slice(h * group, (h + 1) * group)
            col = np.sum(wq[:, q_heads] ** 2, axis=(0, 1))                 # [d]
            blind = int(np.argmin(col[:half] + col[half:]))
            out["k_blind_pair"][i, h] = blind
            out["v_blind_channel"][i, h] = int(np.argmin(np.sum(wo[q_heads] ** 2, axis=(0, 2))))
            amax = np.abs(k[..., h, :]).max(axis=(0, 1))                    # [d]
            pair = np.maximum(amax[:half], amax[half:])
            pair[blind] = -1
            out["k_outlier_pair"][i, h] = int(np.argmax(pair))
            out["k_amax"][i, h] = np.abs(k[..., h, :]).max()
            out["v_amax"][i, h] = np.abs(v[..., h, :]).max()
    return out


def case_params(cfg, params, channels, case, blind=True):
    """The model of one case: the blind channels' weights zeroed (``blind``), the outlier K
    pairs scaled in ``wk`` and compensated in ``wq``, and ``params["outliers"]`` for
    :func:`inject_sink`."""
    d, half = cfg.head_size, cfg.head_size // 2
    group = cfg.num_q_heads // cfg.num_kv_heads
    layers = []
    for i, layer in enumerate(params["layers"]):
        wq = np.array(layer["wq"]).reshape(cfg.d_model, cfg.num_q_heads, d)
        wk = np.array(layer["wk"]).reshape(cfg.d_model, cfg.num_kv_heads, d)
        wo = np.array(layer["wo"]).reshape(cfg.num_q_heads, d, cfg.d_model)
        for h in range(cfg.num_kv_heads):
            q_heads = slice(h * group, (h + 1) * group)
            if blind:
                p = channels["k_blind_pair"][i, h]
                wq[:, q_heads, [p, p + half]] = 0
                wo[q_heads, channels["v_blind_channel"][i, h]] = 0
            p = channels["k_outlier_pair"][i, h]
            wk[:, h, [p, p + half]] *= np.float32(case.channel)
            wq[:, q_heads, [p, p + half]] /= np.float32(case.channel)
        layers.append(dict(layer, wq=jnp.asarray(wq.reshape(cfg.d_model, -1)),
                           wk=jnp.asarray(wk.reshape(cfg.d_model, -1)),
                           wo=jnp.asarray(wo.reshape(-1, cfg.d_model))))
    sink = case.token if case.token != 1 else 0.0                      # 0: no sink
    outliers = dict(sink_k=jnp.asarray(sink * channels["k_amax"], jnp.float32),
                    sink_v=jnp.asarray(sink * channels["v_amax"], jnp.float32),
                    k_channel=jnp.asarray(channels["k_blind_pair"]),
                    v_channel=jnp.asarray(channels["v_blind_channel"]))
    return dict(params, layers=layers, outliers=outliers)


def case_stats(cfg, p, calib):
    """Calibration amax per layer and side: ``{"global", "per_head", "rotated"}``, each a list
    of [K, V] dicts with ``amax`` (per head: an [H] array), as quality_bench.format_scales
    takes them."""
    inputs = qb.cache_inputs(cfg, p, calib, inject=inject_sink)
    h = qb.hadamard(cfg.head_size)
    amax = lambda x, axis=None: {"amax": np.abs(x).max(axis=axis)}      # noqa: E731

    def channels(x):                     # amax of x / f times f: the scale rule's result is
        f = np.asarray(jax_nvfp4.channel_factors(np.abs(x).max(axis=(0, 1))))   # g f [H, D]
        return {"amax": np.abs(x / f).max() * f}

    return {"global": [[amax(x) for x in layer] for layer in inputs],
            "per_head": [[amax(x, (0, 1, 3)) for x in layer] for layer in inputs],
            "rotated": [[amax(x @ h) for x in layer] for layer in inputs],
            "channels": [[channels(x) for x in layer] for layer in inputs]}


def stats_for(fmt, stats):
    if fmt.round_trip.endswith("per_head"):
        return stats["per_head"]
    if fmt.round_trip.endswith("channels"):
        return stats["channels"]
    return stats["rotated" if "hadamard" in fmt.round_trip else "global"]


def model(cases=MODEL_CASES, formats=MODEL_FORMATS, windows_per_file=WINDOWS_PER_FILE,
          file_stride=1, length=None, calibration_windows=qb.CALIBRATION_WINDOWS, log=print):
    """The model table's results: every case, every format, on the last of each held-out
    file's ``windows_per_file`` windows (every ``file_stride``-th file; the first ``length``
    predictions when given)."""
    cfg, params, meta = qb.tiny_lm.load_weights()
    split = qb.stdlib_corpus.load_split(heldout=True)
    windows, owners = qb.stdlib_corpus.heldout_windows(split, qb.train_tiny_lm.EVAL_LENGTH,
                                                       windows_per_file)
    last = np.r_[np.flatnonzero(np.diff(owners)), len(owners) - 1]     # each file's last
    keep = last[np.isin(owners[last], np.unique(owners)[::file_stride])]
    windows, owners = windows[keep], owners[keep]
    if length is not None:
        windows = windows[:, :length + 1]
    positions = windows.shape[1] - 1
    calib = qb.calibration_windows(calibration_windows)
    if length is not None:
        calib = calib[:, :length + 1]
    log(f"model: {qb.tiny_lm.TRAINED_WEIGHTS.name}; held-out: {len(windows)} windows of "
        f"{windows.shape[1]} bytes from {len(np.unique(owners))} files; calibration: "
        f"{len(calib)} windows")
    channels = model_channels(cfg, params, qb.cache_inputs(cfg, params, calib))

    # What blinding the sink's channels costs the float32 model (every case has it).
    plain = qb.teacher_forced(cfg, case_params(cfg, params, channels, cases[0], blind=False),
                              windows, formats[:1], None, inject=inject_sink, log=lambda *a: None)
    out = dict(windows=len(windows), files=int(len(np.unique(owners))), positions=positions,
               calibration_windows=len(calib),
               channels={k: v.tolist() for k, v in channels.items()}, cases={})
    results_by_case = {}
    for case in cases:
        log(f"{case.label}:")
        p = case_params(cfg, params, channels, case)
        stats = case_stats(cfg, p, calib)
        results = qb.teacher_forced(
            cfg, p, windows, formats, None, log=log, inject=inject_sink,
            scales_of=lambda fmt: qb.format_scales(fmt, stats_for(fmt, stats)))
        results_by_case[case.label] = results
        # Held-out data larger than the calibration's is clipped at headroom 1.
        heldout = qb.cache_inputs(cfg, p, windows, inject=inject_sink)
        beyond = max(float(np.abs(x).max()) / side["amax"]
                     for layer, cal in zip(heldout, stats["global"]) for x, side in zip(layer, cal))
        log(f"  held-out amax / calibration amax (largest over layers and sides): {beyond:.3f}")
        summary = qb.summarise(results, owners, positions)
        comparisons = {f"{a} - {b}": qb.paired_delta(results, owners, positions, a, b)
                       for a, b in COMPARISONS if a in results and b in results}
        out["cases"][case.label] = dict(summary=summary, comparisons=comparisons,
                                        heldout_over_calibration_amax=beyond,
                                        calibration_amax={k: [[np.asarray(s["amax"]).tolist()
                                                               for s in layer] for layer in v]
                                                          for k, v in stats.items()})
    first = results_by_case[cases[0].label]["float32"]
    both = {"blinded": first, "shipped": plain["float32"]}
    out["float32_shipped_bits_per_byte"] = float(plain["float32"]["bits"].sum()
                                                 / (len(windows) * positions))
    out["float32_blinding_cost"] = qb.paired_delta(both, owners, positions, "blinded", "shipped")
    return out


def model_tables(result, cases, formats):
    """Markdown: Δ bits/byte, KL and argmax agreement as format x case matrices, and the paired
    comparisons."""
    labels = [c.label for c in cases if c.label in result["cases"]]
    head = "| KV cache | " + " | ".join(labels) + " |"
    rule = "| --- |" + " ---: |" * len(labels)
    rows = {label: result["cases"][label]["summary"] for label in labels}
    quant = [f for f in formats if f.round_trip != "float32"]

    def matrix(title, cell, first=None):
        lines = [f"**{title}**", "", head, rule]
        if first:
            lines.append(first)
        for f in quant:
            lines.append(f"| {f.label} | " + " | ".join(cell(rows[c][f.label]) for c in labels)
                         + " |")
        return "\n".join(lines)

    float32 = ("| float32 (bits/byte) | "
               + " | ".join(f"{rows[c]['float32']['bits_per_byte']:.4f}" for c in labels) + " |")
    out = [matrix("Δ bits/byte vs float32 with the same outliers (± SE, paired)",
                  lambda r: f"{r['delta_bits_per_byte']:+.4f} ± {r['delta_se']:.4f}", float32),
           matrix("mean KL(float32 || format), nats (± SE)",
                  lambda r: f"{r['kl_nats']:.2g} ± {r['kl_nats_se']:.1g}"),
           matrix("argmax agreement with float32",
                  lambda r: f"{100 * r['argmax_agreement']:.2f}%")]
    comps = [f"{a} - {b}" for a, b in COMPARISONS
             if all(f"{a} - {b}" in result["cases"][c]["comparisons"] for c in labels)]
    if comps:
        lines = ["**remedy minus the same without it: Δ bits/byte (± SE, paired)**", "",
                 head.replace("KV cache", "comparison"), rule]
        for comp in comps:
            cells = [result["cases"][c]["comparisons"][comp] for c in labels]
            lines.append(f"| {comp} | " + " | ".join(f"{d:+.4f} ± {se:.4f}" for d, se in cells)
                         + " |")
        out.append("\n".join(lines))
    return out


# --------------------------------------------------------------------------- driver


QUICK = dict(syn_cases=(SYN_CASES[0], SYN_CASES[4], SYN_CASES[6]), syn_shape=(64, 8, 128),
             model_cases=(MODEL_CASES[0], MODEL_CASES[4], MODEL_CASES[6]),
             model_formats=tuple(MODEL_FORMATS[i] for i in (0, 2, 3, 6, 8)),
             model_kwargs=dict(file_stride=20, length=64, calibration_windows=4))
FULL = dict(syn_cases=SYN_CASES, syn_shape=SYN_SHAPE, model_cases=MODEL_CASES,
            model_formats=MODEL_FORMATS, model_kwargs={})


def run(quick=False, log=print):
    """Both parts; a results dict with the tables as Markdown under ``markdown``."""
    with jax.default_matmul_precision("highest"):
        return _run(QUICK if quick else FULL, quick, log)


def _run(plan, quick, log):
    t_start = time.perf_counter()
    log("synthetic tensors:")
    syn, worst = synthetic(plan["syn_cases"], SYN_METHODS, plan["syn_shape"], log=log)
    if worst != 0:
        raise AssertionError(f"the store path (reshape_and_cache + dequantize) differs from the "
                             f"round trip by up to {worst}")
    syn_s = time.perf_counter() - t_start
    log("trained model:")
    mod = model(plan["model_cases"], plan["model_formats"], log=log, **plan["model_kwargs"])
    md = [f"Store path check: every NVFP4 cell stored with jax_nvfp4.reshape_and_cache and read "
          f"with jax_nvfp4.dequantize equals the round trip bit for bit (largest difference "
          f"{worst:g}).", SYN_LEGEND]
    md += synthetic_tables(syn, plan["syn_cases"], SYN_METHODS, plan["syn_shape"])
    d, se = mod["float32_blinding_cost"]
    beyond = {c: r["heldout_over_calibration_amax"] for c, r in mod["cases"].items()}
    md.append(f"Model: {mod['windows']} held-out windows of {mod['positions']} scored bytes "
              f"from {mod['files']} files; global scales from {mod['calibration_windows']} "
              f"calibration windows with the same outliers. float32 with the sink's channels "
              f"blinded (every case): {d:+.4f} ± {se:.4f} bits/byte against the shipped "
              f"weights ({mod['float32_shipped_bits_per_byte']:.4f}). The held-out K and V's "
              f"largest magnitude over the calibration amax (largest over layers and sides; "
              f"above 1 headroom 1 clips): "
              + ", ".join(f"{c} {b:.2f}" for c, b in beyond.items()) + ".")
    md += model_tables(mod, plan["model_cases"], plan["model_formats"])
    return dict(quick=quick, date=datetime.date.today().isoformat(), jax=jax.__version__,
                backend=jax.default_backend(), cpu_count=os.cpu_count(),
                python=qb.stdlib_corpus.python_version(), synthetic_shape=plan["syn_shape"],
                synthetic=syn, store_path_max_difference=worst, model=mod,
                synthetic_s=syn_s, wall_s=time.perf_counter() - t_start, markdown=md)


SMOKE_NOTE = ("NOTE: --quick: a smoke run (64-token tensors, 3 cases; the model on a window of "
              "64 bytes from every 20th held-out file, 3 cases, 5 formats): it checks that the benchmark runs, its numbers "
              "are not the measurement.")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    p.add_argument("--out", type=pathlib.Path, default=qb.ROOT / "benchmarks" / "out")
    a = p.parse_args(argv)
    if a.quick:
        print(SMOKE_NOTE, flush=True)
    result = run(quick=a.quick)
    a.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = a.out / "outlier_bench.json", a.out / "outlier_bench.md"
    json_path.write_text(json.dumps({k: v for k, v in result.items() if k != "markdown"},
                                    indent=1, default=float))
    text = "\n\n".join(result["markdown"])
    md_path.write_text(text + "\n")
    print(f"wall time {result['wall_s']:.0f} s; wrote {json_path}, {md_path}\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
