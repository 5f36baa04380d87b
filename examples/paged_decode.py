"""Greedy decoding of a small transformer with an NVFP4 paged KV cache, against a bf16 one.

A decoder-only model (examples/tiny_lm.py: RMSNorm, RoPE, grouped-query attention with 8 query /
2 kv heads of 64, SwiGLU MLP) generates text for several prompts of different lengths. By
default it is the byte-level model examples/train_tiny_lm.py trained on the Python standard
library's source (weights in examples/tiny_lm.npz), computing in float32, and the prompts are
held-out standard-library text it was not trained on; ``--random-weights`` runs random seeded
bf16 weights of any size on random prompts instead. A host-side block allocator hands out
pages and builds ``block_tables`` and ``slot_mapping``.

The same model runs twice, with a bf16 paged cache and with the NVFP4 cache:

* **bf16** (``.at[slots].set`` + ``paged_attention_bf16``): a dense causal prefill over the
  prompts writes their K/V into each layer's paged cache at once (there is no ragged reader
  for a bf16 cache).
* **NVFP4** (``jax_nvfp4.reshape_and_cache`` + ``ragged_paged_attention`` /
  ``paged_attention``): chunked prefill through the cache. All prompts go together,
  ``--prefill-chunk`` tokens each per step (24 by default, not a multiple of the 16-token page,
  so the default prompts of 64 to 160 tokens take 3 to 7 chunks); a step packs the chunks of
  the sequences with prompt left (``cu_q_lens``, ``num_seqs``), padded to a fixed number of
  tokens so one compiled step serves every chunk, and per layer stores the chunk's K/V, then
  lets its queries attend with ``ragged_paged_attention`` to the earlier chunks and causally
  to the chunk itself. Its logits at every prompt position are checked against the dense
  prefill with each layer's K/V passed through the NVFP4 format the same way
  (``jax_nvfp4.reference.quantize_blocks``, read back as the cache reads it), within
  ``MATCH_BOUNDS`` (measured; see there). The scales are calibrated once from the plain dense
  prefill's K/V.

Then each run decodes with one step function, compiled once with ``jax.jit``, whose per-layer
caches are donated and updated in place: the new token's K/V are stored, then paged attention
reads each sequence's pages. Each run's first token comes from its own prefill. The decode
loop reserves every step's page up front and sends the block tables to the device once; a step
computes its slots from them and the lengths, and returns the next step's lengths and tokens,
so nothing crosses from the host while it decodes (as in an engine's device-resident loop;
with ``--teacher-force``, each step's forced tokens do). ``--steps-per-call N`` runs N steps a
call as a ``lax.scan`` (one host dispatch for N tokens a sequence, as vLLM's multi-step
scheduling does); on the CPU its tokens and logits equal one step a call's bit for bit (tested).

A speculative-decoding check follows, k = ``--draft-tokens`` (default 4). The draft model is
the model itself: its drafts are the tokens the NVFP4 decode generated greedily, so all are
accepted. From a copy of the NVFP4 caches as the prefill left them, ONE verify step takes per
sequence the k tokens the first k decode steps consumed (the prefill's token and k - 1
drafts), stores their K/V and attends with ``ragged_paged_attention``, k query tokens per
sequence; its k logits (which verify those drafts and the k-th) must equal those of the k
token-by-token decode steps within ``MATCH_BOUNDS`` (and so pick the same tokens, but at a
tie closer than that). It is the chunked prefill's step compiled once more, for k tokens per
sequence and with ``max_q_len=k``: an engine knows its verify step's query count, and the bound
lets the GPU serve it with the few-row kernel alone (benchmarks/RESULTS.md). (With
``--teacher-force`` the decode consumed the bf16 run's tokens: those are the drafts then, and
not all need be accepted.)

It prints the verdict first: per cache, decode tokens/s, cache bytes per token and how much
more context fits in the same memory; then how often the NVFP4 run picks the same greedy token
as the bf16 run from the same history (its prefill's token included), how far their logits are
apart (mean KL divergence and absolute difference); a line each for the chunked-prefill and
the speculative-decoding check (``FAILED`` and exit status 1 beyond a bound); and (trained
model) the text each run generated under the end of each prompt. benchmarks/quality_bench.py
measures what the caches cost in held-out bits per byte. ``--verbose`` adds the internals
(device, scales, compile and donation checks, the prefill's steps, sample tokens). Progress
goes to stderr: a bar on a terminal, occasional lines in a log. Runs on JAX's default device
(the GPU when there is one; there the bounds of the two checks were measured on an H200 for the
trained model and are provisional for random weights, see ``MATCH_BOUNDS``).

With ``--long-context`` it instead times one decode step over caches that already hold
``--context`` tokens per sequence (default 32 x 32768 tokens, 4 Llama-3-8B-shaped layers:
32 q / 8 kv heads of 128, page 16): the caches are filled with random valid values on the
device (no prefill), the block tables are a random permutation of an exactly sized page pool,
and the NVFP4 step (the fused CUDA kernel on a GPU) is timed against the bf16 one, with cache
bytes per token and how many more tokens fit in the same memory.

    python examples/paged_decode.py
    python examples/paged_decode.py --prefill-chunk 7 --draft-tokens 8
    python examples/paged_decode.py --batch 8 --prompt-lens 5 60 130 --steps 64 --layout NHD
    python examples/paged_decode.py --random-weights --layers 2 --vocab 1024
    python examples/paged_decode.py --long-context --batch 32 --context 32768 --layers 4
"""

import argparse
import copy
import dataclasses
import functools
import math
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from jax_nvfp4 import reference
from jax_nvfp4.attention import paged_attention, paged_attention_bf16, ragged_paged_attention
from jax_nvfp4.attention_primitive import DECODE_TARGET as _DECODE_TARGET
from jax_nvfp4.attention_primitive import KERNEL_HEAD_SIZES as _KERNEL_HEAD_SIZES
from jax_nvfp4.ragged_primitive import kernel_supports as ragged_kernel_supports

# The model and its data live beside this file (also when it is loaded from elsewhere).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402
import tiny_lm  # noqa: E402
from tiny_lm import forward, init_params, logits_of, mlp_block, qkv  # noqa: E402

KINDS = ("bf16", "nvfp4")


_TRAINED = tiny_lm.ModelConfig()


@dataclasses.dataclass
class Config:
    batch: int = 4
    prompt_lens: tuple = (64, 96, 128, 160)   # cycled when batch is larger
    steps: int = 48
    steps_per_call: int = 1                # decode steps per jitted call (a lax.scan of them)
    prefill_chunk: int = 24                # prompt tokens per sequence per chunked-prefill step
    draft_tokens: int = 4                  # tokens of the speculative-decoding verify step
    # The model's sizes: the trained model's (examples/tiny_lm.npz); others need random weights.
    layers: int = _TRAINED.layers
    d_model: int = _TRAINED.d_model
    num_q_heads: int = _TRAINED.num_q_heads
    num_kv_heads: int = _TRAINED.num_kv_heads
    head_size: int = _TRAINED.head_size
    mlp: int = _TRAINED.mlp
    vocab: int = _TRAINED.vocab
    random_weights: bool = False           # random seeded weights instead of the trained model
    block_size: int = 16
    layout: str = "HND"
    scale_search: str = "default"
    extra_blocks: int = 8                  # pages beyond what the sequences need
    teacher_force: bool = False            # NVFP4 run fed the bf16 run's tokens
    seed: int = 0
    progress: bool = True                  # stage lines and progress bars on stderr
    report: bool = True                    # print the results (the verdict first)
    verbose: bool = False                  # also print the run's internals
    # --long-context mode (see run_long_context): caches pre-filled to ``context`` tokens.
    long_context: bool = False
    context: int = 32768                   # tokens already in each sequence's cache
    repeats: int = 5                       # timings of ``steps`` steps; the median is reported
    warmup: int = 2                        # untimed calls (of steps_per_call steps) after compiling
    nvfp4_jnp: bool = False                # also time the NVFP4 cache with impl="jnp"


#: Defaults that --long-context changes: Llama-3-8B-shaped layers (random weights, a small
#: vocabulary), 32 sequences of 32k tokens. Options given on the command line win.
LONG_CONTEXT_DEFAULTS = dict(batch=32, context=32768, layers=4, d_model=4096, num_q_heads=32,
                             num_kv_heads=8, head_size=128, mlp=14336, vocab=32000,
                             block_size=16, steps=10)


#: Bounds of the example's two checks, on the largest |logit difference| over every position
#: compared: chunked prefill through the NVFP4 cache against the dense prefill with K/V through
#: NVFP4 (every prompt position), and the speculative verify step against the token-by-token
#: decode steps (the k positions of every sequence). Keyed by (reader path of
#: ragged_paged_attention, model dtype); bf16 bounds are per layer (rounding differences of the
#: two computation orders pass through every layer and grow with depth).
#:
#: Measured on the CPU (jnp readers), jax 0.10.2:
#:
#: * trained model, float32: prefill <= 1.3e-5, verify <= 1.1e-5 (chunks of 1, 5, 16, 24, 32 and
#:   160 tokens, both layouts, both scale searches, --teacher-force, 16 draft tokens, batch 8
#:   --prompt-lens 5 60 130): the same numbers summed in another order. Bounds 1e-3.
#: * random bf16 weights: prefill max 0.065..0.115 at 2 layers (the tests' size, seeds 0..9),
#:   0.16..0.23 at 4 (the default sizes, seeds 0..3), 0.33 at 8, 0.45 at 16: at most 0.058 per
#:   layer. tiny_lm's dense attention rounds the softmax weights and its output to bf16, the
#:   paged readers attend in float32, and a last-bit difference in a later layer's K or V can
#:   move it to the next E2M1 code. Verify: 0 to 0.025 at 1..8 layers, 0.053 at 16, at most
#:   0.0061 per layer. Bounds 0.15 and 0.025 per layer.
#:
#: On a GPU the ragged and decode kernels round q and the softmax weights to fp16 and XLA runs
#: float32 products in TF32 (the decode kernel was measured 0.55 from the dense round trip on
#: the trained model, benchmarks/RESULTS.md, "On a GPU"). Measured on an H200 (jax 0.11.2,
#: 2026-12-01), trained model, default run: chunked prefill max 0.62 (mean 0.023, same argmax at
#: 445 of 448 positions: near-ties), verify 0.024. Bounds 1.5 and 0.1. Random bf16 weights on a
#: GPU: not measured yet (provisional bounds, 2x the CPU's).
MATCH_BOUNDS = {
    ("jnp", "float32"): dict(prefill=1e-3, verify=1e-3, per_layer=False, measured=True),
    ("jnp", "bfloat16"): dict(prefill=0.15, verify=0.025, per_layer=True, measured=True),
    ("kernel", "float32"): dict(prefill=1.5, verify=0.1, per_layer=False, measured=True),
    ("kernel", "bfloat16"): dict(prefill=0.3, verify=0.05, per_layer=True, measured=False),
}


# --------------------------------------------------------------------------- block allocator


class BlockAllocator:
    """Host-side page allocator: each sequence owns a list of pages, grown a page at a time.

    Pages come from a free list (shuffled with ``seed``, so sequences get scattered pages as in
    a long-running server). ``block_tables()`` pads every row to ``max_blocks_per_seq`` with -1,
    which ``paged_attention`` ignores, so the decode step sees one shape and compiles once.
    """

    def __init__(self, num_blocks, block_size, max_blocks_per_seq, seed=None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        free = np.arange(num_blocks)
        if seed is not None:
            free = np.random.default_rng(seed).permutation(free)
        self._free = [int(p) for p in free[::-1]]       # pop() from the end
        self._pages: dict = {}
        self._lens: dict = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add_sequence(self, seq_id):
        if seq_id in self._pages:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._pages[seq_id], self._lens[seq_id] = [], 0

    def append_slots(self, seq_id, num_tokens: int) -> np.ndarray:
        """Reserves the next ``num_tokens`` positions of a sequence; returns their slots."""
        pages, start = self._pages[seq_id], self._lens[seq_id]
        end = start + num_tokens
        new_pages = -(-end // self.block_size) - len(pages)
        if len(pages) + new_pages > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq_id!r} would exceed {self.max_blocks_per_seq} pages")
        if new_pages > len(self._free):
            raise RuntimeError(f"out of KV-cache pages ({new_pages} needed, "
                               f"{len(self._free)} free)")
        pages.extend(self._free.pop() for _ in range(new_pages))
        self._lens[seq_id] = end
        pos = np.arange(start, end)
        return (np.asarray(pages, np.int64)[pos // self.block_size] * self.block_size
                + pos % self.block_size).astype(np.int32)

    def free_sequence(self, seq_id):
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def block_tables(self, seq_ids) -> np.ndarray:
        tables = np.full((len(seq_ids), self.max_blocks_per_seq), -1, np.int32)
        for row, s in enumerate(seq_ids):
            tables[row, :len(self._pages[s])] = self._pages[s]
        return tables

    def seq_lens(self, seq_ids) -> np.ndarray:
        return np.asarray([self._lens[s] for s in seq_ids], np.int32)


# --------------------------------------------------------------------------- model


# The model (params, RoPE, grouped-query attention, MLP, dense prefill) lives in tiny_lm.py,
# shared with the training script and benchmarks/quality_bench.py; the paged cache is here.


def calibrate(ks, vs, lens):
    """Per-layer k_scale, v_scale: amax of the prompts' valid tokens / 448 (docs/format.md §1)."""
    valid = (jnp.arange(ks[0].shape[1])[None, :] < lens[:, None])[..., None, None]

    def scale(x):
        return jnp.max(jnp.where(valid, jnp.abs(x.astype(jnp.float32)), 0.0)) / 448.0

    return tuple((scale(k), scale(v)) for k, v in zip(ks, vs))


def store_bf16(key, value, cache, slot_mapping):
    """bf16 twin of reshape_and_cache: cache = (k [num_blocks, T, H, D], v); -1 slots skipped."""
    k_cache, v_cache = cache
    num_blocks, block_size, heads, head_size = k_cache.shape
    slots = jnp.where(slot_mapping < 0, num_blocks * block_size, slot_mapping)  # dropped
    flat = (num_blocks * block_size, heads, head_size)
    return tuple(c.reshape(flat).at[slots].set(x.astype(c.dtype), mode="drop").reshape(c.shape)
                 for c, x in ((k_cache, key), (v_cache, value)))


def store(cfg, kind, key, value, cache, slot_mapping, scales):
    if kind == "nvfp4":
        # The store takes bf16/fp16: a float32 model's K/V go in as bf16 (what the bf16 cache
        # holds too), so the two caches start from the same values.
        key, value = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x
                      for x in (key, value))
        return jax_nvfp4.reshape_and_cache(key, value, cache, slot_mapping, *scales,
                                           layout=cfg.layout, scale_search=cfg.scale_search)
    return store_bf16(key, value, cache, slot_mapping)


def make_prefill_store(cfg, kind):
    """All layers' prompt K/V into their caches, caches donated (updated in place)."""

    def fn(caches, ks, vs, slot_mapping, scales):
        flat = (-1, cfg.num_kv_heads, cfg.head_size)
        return tuple(store(cfg, kind, k.reshape(flat), v.reshape(flat), c, slot_mapping, s)
                     for c, k, v, s in zip(caches, ks, vs, scales))

    return jax.jit(fn, donate_argnums=0)


def decode_slots(block_tables, seq_lens, block_size):
    """The cache slot of each sequence's newest token (position ``seq_lens - 1``), from its
    block table on the device: ``block_tables`` must hold that position's page."""
    pos = seq_lens - 1
    pages = jnp.take_along_axis(block_tables, (pos // block_size)[:, None], axis=1)[:, 0]
    return pages * block_size + pos % block_size


def make_decode_step(cfg, kind, trace_counter, impl="auto"):
    """The decode step, compiled once: (params, caches, scales, tokens, block_tables, seq_lens)
    -> ((caches, seq_lens + 1), (next tokens, logits)): the loop's state, then its outputs.

    ``seq_lens`` counts each sequence's tokens including the one this step stores (at position
    ``seq_lens - 1``, in the slot ``decode_slots`` reads from ``block_tables``, whose pages the
    caller reserved ahead). Caches (argument 1) and seq_lens (argument 5) are donated, and a
    decode loop feeds each step the previous step's tokens and seq_lens with the same block
    tables: nothing crosses from the host per step, and the custom calls' operands keep their
    device addresses from step to step (XLA records an FFI call into its command buffer again
    whenever one of its buffers moved: benchmarks/NOTES.md, "The example's decode step").
    (The state comes first: JAX gives a donated buffer to the first output of its shape and
    type, and seq_lens must go to seq_lens + 1, not to the tokens.)

    ``trace_counter[kind]`` counts how often JAX traces it (once, if nothing recompiles).
    ``impl`` is the NVFP4 reader's (``paged_attention(impl=...)``): ``"auto"`` runs the fused
    CUDA kernel on a GPU and the jnp path elsewhere.

    With ``cfg.steps_per_call`` = k > 1 one call runs k steps as a ``lax.scan``, each step's
    greedy tokens fed to the next on the device: (params, caches, scales, tokens, block_tables,
    seq_lens, forced) -> ((caches, seq_lens + k, the last step's tokens), (tokens [k, B],
    logits [k, B, vocab])), one host dispatch for k tokens a sequence (vLLM's multi-step
    scheduling). ``forced`` is None (free-running) or [k, B] tokens that replace each step's
    input (teacher forcing); the caller reserves the pages of all k positions before the call.
    """

    def step(params, caches, scales, tokens, block_tables, seq_lens):
        trace_counter[kind] += 1
        positions = seq_lens - 1                        # the new token's position
        slot_mapping = decode_slots(block_tables, seq_lens, cfg.block_size)
        x = params["embed"][tokens]                     # [B, d]
        new_caches = []
        for layer, cache, scale in zip(params["layers"], caches, scales):
            q, k, v = qkv(cfg, layer, x, positions)     # [B, heads, D]
            cache = store(cfg, kind, k, v, cache, slot_mapping, scale)
            if kind == "nvfp4":
                attn = paged_attention(q, cache, block_tables, seq_lens, *scale,
                                       layout=cfg.layout, impl=impl)
            else:
                attn = paged_attention_bf16(q, *cache, block_tables, seq_lens)
            new_caches.append(cache)
            x = x + attn.reshape(x.shape[0], -1) @ layer["wo"]
            x = x + mlp_block(layer, x)
        logits = logits_of(params, x)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (tuple(new_caches), seq_lens + 1), (tokens, logits)

    k = cfg.steps_per_call
    if k == 1:
        return jax.jit(step, donate_argnums=(1, 5))

    def steps(params, caches, scales, tokens, block_tables, seq_lens, forced):
        def body(carry, forced_tokens):
            caches, seq_lens, tokens = carry
            if forced_tokens is not None:
                tokens = forced_tokens
            (caches, seq_lens), (tokens, logits) = step(params, caches, scales, tokens,
                                                        block_tables, seq_lens)
            return (caches, seq_lens, tokens), (tokens, logits)

        # The state in the order of the single step's (seq_lens donated before the tokens of
        # the same shape and type: JAX gives it the first such output).
        return jax.lax.scan(body, (caches, seq_lens, tokens), forced, length=k)

    return jax.jit(steps, donate_argnums=(1, 5))


def decode_step_args(k, params, caches, scales, tokens, block_tables, seq_lens, forced=None):
    """The arguments of one call of :func:`make_decode_step`'s function of ``k`` steps a call.
    ``forced``: None, or the k steps' input tokens [k, B] (host), which replace ``tokens``."""
    if k == 1:
        if forced is not None:
            tokens = jnp.asarray(forced[0])
        return params, caches, scales, tokens, block_tables, seq_lens
    return (params, caches, scales, tokens, block_tables, seq_lens,
            None if forced is None else jnp.asarray(forced))


def decode_step_outputs(k, outputs):
    """One call's outputs (:func:`make_decode_step`, ``k`` steps a call) as (caches, seq_lens,
    the next call's input tokens, tokens, logits): tokens [B] and logits [B, vocab] for k = 1,
    [k, B] and [k, B, vocab] for k > 1."""
    if k == 1:
        (caches, seq_lens), (tokens, logits) = outputs
        return caches, seq_lens, tokens, tokens, logits
    (caches, seq_lens, last), (tokens, logits) = outputs
    return caches, seq_lens, last, tokens, logits


def make_ragged_step(cfg, trace_counter, impl="auto", max_q_len=None, name="ragged"):
    """The NVFP4 step over several tokens per sequence, compiled once for a fixed number of
    packed tokens: (params, caches, scales, tokens [T], positions [T], slot_mapping [T],
    block_tables [S, M], seq_lens [S], cu_q_lens [S + 1], num_seqs) -> (logits [T, vocab],
    caches). Caches (argument 1) are donated.

    Per layer the tokens' K/V are stored first (``reshape_and_cache``; padding tokens have slot
    -1), then their queries attend causally with ``ragged_paged_attention`` over everything
    their sequence has in the cache, themselves included. Chunked prefill runs it, and the
    speculative verify step runs it compiled with ``max_q_len`` (no sequence has more query
    tokens: the bound picks the GPU's fastest plan); ``cu_q_lens``, ``num_seqs`` and
    ``seq_lens`` are device values, so neither a different chunk nor a shrinking batch
    recompiles. ``trace_counter[name]`` counts its traces.
    """

    def step(params, caches, scales, tokens, positions, slot_mapping, block_tables, seq_lens,
             cu_q_lens, num_seqs):
        trace_counter[name] += 1
        x = params["embed"][tokens]                     # [T, d]
        new_caches = []
        for layer, cache, scale in zip(params["layers"], caches, scales):
            q, k, v = qkv(cfg, layer, x, positions)     # [T, heads, D]
            cache = store(cfg, "nvfp4", k, v, cache, slot_mapping, scale)
            attn = ragged_paged_attention(q, cache, block_tables, seq_lens, cu_q_lens, num_seqs,
                                          *scale, layout=cfg.layout, impl=impl,
                                          max_q_len=max_q_len)
            new_caches.append(cache)
            x = x + attn.reshape(x.shape[0], -1) @ layer["wo"]
            x = x + mlp_block(layer, x)
        return logits_of(params, x), tuple(new_caches)

    return jax.jit(step, donate_argnums=1)


def nvfp4_round_trip(x, scale, scale_search="default"):
    """K or V [..., head_size] as the NVFP4 cache hands them back: cast to bf16 (what the store
    is given), quantised by the library's quantiser (``jax_nvfp4.reference.quantize_blocks``:
    the bytes ``reshape_and_cache`` writes) and read back as the readers do,
    ``(E2M1 code * E4M3 block scale) * global scale`` in float32 (docs/format.md §1)."""
    blocks = x.astype(jnp.bfloat16).astype(jnp.float32).reshape(*x.shape[:-1], -1, 16)
    codes, scale_bytes = reference.quantize_blocks(blocks, scale, scale_search)
    values = reference.e2m1_values(codes) * reference.e4m3_decode(scale_bytes)[..., None]
    return (values * scale).reshape(x.shape)


def make_dense_forward(cfg):
    """The dense causal forward over the padded prompts, compiled once for two uses:
    (params, prompts [B, L], lens [B], scales, through_nvfp4) -> (logits [B, L, vocab], ks, vs).

    ``through_nvfp4=False`` is the plain dense prefill (the bf16 run's prefill, and the K/V the
    scales are calibrated from; ``scales`` unused). ``through_nvfp4=True`` passes each layer's
    K/V through the NVFP4 format with the cache's ``scales`` (:func:`nvfp4_round_trip`), so
    that every position attends to what the cache would hand back: what chunked prefill
    through the cache computes, in one dense pass (its reference). ``ks, vs`` are the K/V
    before the round trip.
    """

    def fn(params, prompts, lens, scales, through_nvfp4):
        def transform(i, k, v):
            return tuple(jnp.where(through_nvfp4, nvfp4_round_trip(x, s, cfg.scale_search), x)
                         for x, s in ((k, scales[i][0]), (v, scales[i][1])))

        return forward(cfg, params, prompts, lens, kv_transform=transform)

    return jax.jit(fn)


def allocate_caches(cfg, kind, num_blocks):
    if kind == "nvfp4":
        return tuple(jax_nvfp4.allocate_kv_cache(num_blocks, cfg.block_size, cfg.num_kv_heads,
                                                 cfg.head_size, cfg.layout)
                     for _ in range(cfg.layers))
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
    return tuple((jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
                 for _ in range(cfg.layers))


def _hlo_shape(x) -> str:
    """How HLO text spells an array's type, e.g. ``u8[24,2,2,16,36]``."""
    names = {"uint8": "u8", "bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    return f"{names[np.dtype(x.dtype).name]}[{','.join(map(str, x.shape))}]"


def _hlo_cache_copies(hlo: str, caches) -> int:
    """``copy`` ops in compiled HLO text whose type is exactly a cache array's."""
    return sum(len(re.findall(rf"= {re.escape(shape)}\{{[^}}]*\}} copy\(", hlo))
               for shape in {_hlo_shape(x) for x in jax.tree.leaves(caches)})


def cache_bytes(caches) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(caches))


# --------------------------------------------------------------------------- driver


class Progress:
    """Progress of a stage on stderr: a bar redrawn in place on a terminal; in a log (stderr not
    a terminal) a line at the start, at every quarter and at the end, never a carriage return."""

    def __init__(self, total, desc, enabled=True, stream=None):
        self.total, self.desc, self.n, self.enabled = total, desc, 0, enabled
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._logged = 0            # quarters already logged (non-terminal)
        if enabled and not self.tty:
            self._line(f"{desc}: 0/{total}")

    def _line(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()

    def update(self):
        self.n += 1
        if not self.enabled:
            return
        if self.tty:
            width = 30
            done = width * self.n // self.total
            self.stream.write(f"\r{self.desc}: [{'#' * done}{'.' * (width - done)}] "
                              f"{self.n}/{self.total}")
            self.stream.flush()
            return
        quarter = 4 * self.n // self.total
        if quarter > self._logged and self.n < self.total:
            self._logged = quarter
            self._line(f"{self.desc}: {self.n}/{self.total} "
                       f"({time.perf_counter() - self.t0:.1f} s)")

    def close(self):
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + " " * (len(self.desc) + 50) + "\r")
            self.stream.flush()
        self._line(f"{self.desc}: done, {self.n}/{self.total} in "
                   f"{time.perf_counter() - self.t0:.1f} s")


def stage(cfg, text):
    """One line on stderr saying what the script is doing (prefill, compiling, filling caches):
    the slow parts before the first decode step show progress too."""
    if cfg.progress:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _prompt_lens(cfg):
    lens = list(cfg.prompt_lens)
    if not lens or min(lens) < 1:
        raise ValueError(f"prompt lengths must be >= 1, got {lens}")
    return [lens[i % len(lens)] for i in range(cfg.batch)]


def new_allocator(cfg, num_blocks, max_blocks):
    """A page allocator holding the batch's sequences 0 .. batch - 1, each still empty."""
    alloc = BlockAllocator(num_blocks, cfg.block_size, max_blocks, seed=cfg.seed + 1)
    for s in range(cfg.batch):
        alloc.add_sequence(s)
    return alloc


def dense_prefill_store(cfg, kind, ks, vs, scales, prompt_lens, alloc, num_blocks):
    """The bf16 run's prefill: the dense prefill's K/V of every prompt token into a new paged
    cache per layer, all at once. Returns the caches."""
    length = ks[0].shape[1]
    slot_mapping = np.full((cfg.batch, length), -1, np.int32)
    for s, n in enumerate(prompt_lens):
        slot_mapping[s, :n] = alloc.append_slots(s, n)
    stage(cfg, f"{kind}: storing the prompts' K/V into the paged cache (compiling the store)")
    caches = allocate_caches(cfg, kind, num_blocks)
    return make_prefill_store(cfg, kind)(caches, ks, vs, jnp.asarray(slot_mapping.reshape(-1)),
                                         scales)


def chunk_plan(prompt_lens, chunk):
    """Chunked prefill's steps: per step, ``(sequence, first position, tokens)`` of every
    sequence with prompt tokens left, ``chunk`` tokens each (fewer for a prompt's last chunk)."""
    done, plan = [0] * len(prompt_lens), []
    while True:
        pieces = [(b, done[b], min(chunk, n - done[b])) for b, n in enumerate(prompt_lens)
                  if done[b] < n]
        if not pieces:
            return plan
        for b, _, q in pieces:
            done[b] += q
        plan.append(pieces)


def pack_ragged(cfg, alloc, pieces, num_tokens):
    """One ragged step's inputs for ``pieces``, a list of ``(sequence, token ids)``: reserves
    the tokens' slots (``alloc.append_slots``) and packs them in order, padded to
    ``num_tokens`` (token 0, slot -1: not stored, and nobody's query). The sequences of the
    step are rows ``0 .. len(pieces) - 1`` of block_tables / seq_lens / cu_q_lens and
    ``num_seqs = len(pieces)``; the rows up to ``cfg.batch`` are padding.

    Returns ``(tokens, positions, slot_mapping, block_tables, seq_lens, cu_q_lens, num_seqs)``,
    NumPy int32, the ragged step's arguments after the caches and scales.
    """
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    cu = [0]
    for s, ids in pieces:
        n, o = len(ids), cu[-1]
        if o + n > num_tokens:
            raise ValueError(f"{o + n} query tokens do not fit the step's {num_tokens}")
        positions[o:o + n] = alloc.seq_lens([s])[0] + np.arange(n)
        tokens[o:o + n] = ids
        slots[o:o + n] = alloc.append_slots(s, n)
        cu.append(o + n)
    seqs = [s for s, _ in pieces]
    tables = np.full((cfg.batch, alloc.max_blocks_per_seq), -1, np.int32)
    tables[:len(seqs)] = alloc.block_tables(seqs)
    lens = np.zeros(cfg.batch, np.int32)
    lens[:len(seqs)] = alloc.seq_lens(seqs)
    cu_q_lens = np.full(cfg.batch + 1, cu[-1], np.int32)
    cu_q_lens[:len(cu)] = cu
    return tokens, positions, slots, tables, lens, cu_q_lens, np.int32(len(seqs))


def chunked_prefill(cfg, params, prompts, prompt_lens, alloc, caches, scales, step, num_tokens):
    """The NVFP4 run's prefill: every prompt ``cfg.prefill_chunk`` tokens at a time through the
    cache, all prompts with tokens left together in one ragged step (:func:`make_ragged_step`:
    per layer the chunk's K/V are stored, then its queries attend to the earlier chunks and
    causally to the chunk itself). Returns ``(logits [B, L, vocab] of every prompt position
    (zeros past a prompt's end), caches, info)``."""
    plan = chunk_plan(prompt_lens, cfg.prefill_chunk)
    logits = np.zeros((cfg.batch, prompts.shape[1], cfg.vocab), np.float32)
    stage(cfg, f"nvfp4: chunked prefill, {len(plan)} steps of up to {cfg.prefill_chunk} tokens "
               f"per prompt (compiling the ragged step)")
    progress = Progress(len(plan), "nvfp4: chunked prefill steps", cfg.progress)
    t0 = time.perf_counter()
    first_s, donated = None, None
    for i, pieces in enumerate(plan):
        inputs = pack_ragged(cfg, alloc, [(b, prompts[b, start:start + q])
                                          for b, start, q in pieces], num_tokens)
        old = caches
        out, caches = step(params, caches, scales, *inputs)
        out = np.asarray(out)
        if i == 0:
            first_s = time.perf_counter() - t0
            donated = all(x.is_deleted() for x in jax.tree.leaves(old))
        del old
        o = 0
        for b, start, q in pieces:
            logits[b, start:start + q] = out[o:o + q]
            o += q
        progress.update()
    progress.close()
    info = dict(steps=len(plan), chunks_per_prompt=[-(-n // cfg.prefill_chunk)
                                                    for n in prompt_lens],
                tokens_per_step=[sum(q for _, _, q in pieces) for pieces in plan],
                seqs_per_step=[len(pieces) for pieces in plan], num_tokens=num_tokens,
                first_step_s=first_s, seconds=time.perf_counter() - t0, caches_donated=donated)
    return logits, caches, info


def decode(cfg, kind, params, caches, alloc, first_logits, scales, trace_counter,
           forced_tokens=None):
    """One run's decode from its prefilled ``caches`` (the prompts' tokens allocated in
    ``alloc``): the first token from ``first_logits`` (the last prompt position's), then
    ``cfg.steps`` steps, ``cfg.steps_per_call`` of them a call. Returns a dict."""
    seqs = list(range(cfg.batch))
    k = cfg.steps_per_call
    step = make_decode_step(cfg, kind, trace_counter)
    step_scales = scales if kind == "nvfp4" else tuple(() for _ in scales)

    tokens = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)   # first generated token
    generated, all_logits = [tokens], []     # per call: [B] and [B, vocab], or [k, B], [k, B, V]
    donated = None
    # Every step's page reserved up front (an engine reserves for its length limit), so the
    # block tables stay the same and go to the device once, with the first step's lengths.
    for s in seqs:
        alloc.append_slots(s, cfg.steps)
    tables = jnp.asarray(alloc.block_tables(seqs))
    seq_lens = jnp.asarray(alloc.seq_lens(seqs) - cfg.steps + 1)
    jax.block_until_ready(caches)
    stage(cfg, f"{kind}: compiling the decode step (its first call)")
    progress = Progress(cfg.steps // k, f"{kind}: decode " + ("steps" if k == 1 else
                                                              f"calls of {k} steps"),
                        cfg.progress)
    t0 = time.perf_counter()
    t_first = None
    forced = None
    for i in range(0, cfg.steps, k):
        if forced_tokens is not None:
            forced = forced_tokens[:, i:i + k].T
        old = caches
        caches, seq_lens, tokens, step_tokens, logits = decode_step_outputs(k, step(
            *decode_step_args(k, params, caches, step_scales, tokens, tables, seq_lens, forced)))
        if i == 0:
            jax.block_until_ready(tokens)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            donated = all(x.is_deleted() for x in jax.tree.leaves(old))
        del old
        generated.append(step_tokens)
        all_logits.append(logits)
        progress.update()
    jax.block_until_ready((generated, caches))
    t_rest = time.perf_counter() - t0
    progress.close()

    # How the step compiled: donated caches show up as input/output aliases in the HLO.
    args = decode_step_args(k, params, caches, step_scales, tokens, tables, seq_lens, forced)
    traces = trace_counter[kind]
    hlo = step.lower(*args).compile().as_text()
    header = hlo.split("\n", 1)[0]
    num_aliased = header.count("may-alias") + header.count("must-alias")
    cache_copies = _hlo_cache_copies(hlo, caches)
    return dict(
        tokens=np.concatenate([np.asarray(t).reshape(-1, cfg.batch) for t in generated]).T,
        logits=np.concatenate([np.asarray(x).reshape(-1, *first_logits.shape)
                               for x in all_logits]).transpose(1, 0, 2),  # [B, steps, vocab]
        first_logits=np.asarray(first_logits),                           # [B, vocab]
        first_step_s=t_first,                  # the first call's (k steps with --steps-per-call)
        tokens_per_s=(cfg.batch * (cfg.steps - k) / t_rest if cfg.steps > k else float("nan")),
        cache_bytes=cache_bytes(caches),
        traces=traces,
        jit_cache_size=step._cache_size(),
        caches_donated=donated,
        hlo_aliased_outputs=num_aliased,
        hlo_cache_copies=cache_copies,
        cache_leaves=len(jax.tree.leaves(caches)),
        seq_lens=alloc.seq_lens(seqs),
    )


def verify_step(cfg, params, caches, alloc, scales, step, tokens, num_tokens):
    """Speculative decoding's verify step: ``tokens [B, k]`` (the last accepted token, then k - 1
    drafts) of every sequence in ONE ragged step over ``caches`` (their K/V stored, each query
    attending causally). Returns the logits ``[B, k, vocab]``: row j predicts token j + 1."""
    batch, k = tokens.shape
    inputs = pack_ragged(cfg, alloc, [(b, tokens[b]) for b in range(batch)], num_tokens)
    logits, _ = step(params, caches, scales, *inputs)
    return np.asarray(logits)[:batch * k].reshape(batch, k, -1)


def _ragged_path(cfg, platform) -> str:
    """Which reader ``ragged_paged_attention(impl="auto")`` runs: the CUDA kernel on a GPU (for
    the head sizes it is built for), the jnp path elsewhere."""
    return "kernel" if platform == "gpu" and ragged_kernel_supports(cfg.head_size) else "jnp"


def match_bounds(cfg, platform) -> dict:
    """The bounds of the two checks (max |logit difference|) for this model and reader, from
    ``MATCH_BOUNDS``: ``dict(prefill=, verify=, measured=)``."""
    dtype = "float32" if not cfg.random_weights else "bfloat16"
    b = MATCH_BOUNDS[(_ragged_path(cfg, platform), dtype)]
    times = cfg.layers if b["per_layer"] else 1
    return dict(prefill=b["prefill"] * times, verify=b["verify"] * times, measured=b["measured"])


def _leading_true(x):
    """Per row of a boolean [B, k] array: how many leading entries are True."""
    return np.where(x.all(axis=1), x.shape[1], np.argmin(x, axis=1))


def run(cfg: Config) -> dict:
    """Dense prefill and decode with the bf16 cache; chunked prefill and decode with the NVFP4
    cache, checked against the dense prefill, and the speculative verify step checked against
    the token-by-token steps; the two runs compared. Returns a results dict."""
    t_start = time.perf_counter()
    _check_config(cfg)
    prompt_lens = _prompt_lens(cfg)
    params, model_note = load_model(cfg)
    if cfg.random_weights:
        rng = np.random.default_rng(cfg.seed)
        prompts = np.zeros((cfg.batch, max(prompt_lens)), np.int32)
        for b, n in enumerate(prompt_lens):
            prompts[b, :n] = rng.integers(0, cfg.vocab, n)
        sources, truths = None, None
    else:
        prompts, sources, truths = text_prompts(prompt_lens, cfg.steps + 1)
    platform = _default_device().platform

    lens = jnp.asarray(prompt_lens, jnp.int32)
    stage(cfg, f"prefill: dense attention over {cfg.batch} prompts (compiling and running)")
    dense = make_dense_forward(cfg)
    unit = tuple((jnp.float32(1), jnp.float32(1)) for _ in range(cfg.layers))
    dense_logits, ks, vs = dense(params, jnp.asarray(prompts), lens, unit, False)
    first_logits = dense_logits[jnp.arange(cfg.batch), lens - 1]
    # The global scales of the NVFP4 cache (chunked prefill, its dense reference, the decode):
    # calibrated once, from the plain dense prefill's K/V.
    scales = calibrate(ks, vs, lens)

    total = [n + cfg.steps for n in prompt_lens]
    max_blocks = max(math.ceil(n / cfg.block_size) for n in total)
    num_blocks = sum(math.ceil(n / cfg.block_size) for n in total) + cfg.extra_blocks
    trace_counter = {k: 0 for k in KINDS + ("ragged", "verify")}
    runs = {}
    # bf16: the dense prefill's K/V into its cache (it has no ragged reader), then decode.
    alloc = new_allocator(cfg, num_blocks, max_blocks)
    caches = dense_prefill_store(cfg, "bf16", ks, vs, scales, prompt_lens, alloc, num_blocks)
    del ks, vs
    runs["bf16"] = decode(cfg, "bf16", params, caches, alloc, first_logits, scales,
                          trace_counter)

    # NVFP4: chunked prefill through the cache. One compiled ragged step serves every chunk.
    k = min(cfg.draft_tokens, cfg.steps)
    num_tokens = cfg.batch * cfg.prefill_chunk
    ragged = make_ragged_step(cfg, trace_counter)
    alloc = new_allocator(cfg, num_blocks, max_blocks)
    caches = allocate_caches(cfg, "nvfp4", num_blocks)
    chunk_logits, caches, chunk_info = chunked_prefill(cfg, params, prompts, prompt_lens, alloc,
                                                       caches, scales, ragged, num_tokens)
    stage(cfg, "nvfp4: the dense prefill with K/V through NVFP4 (the reference of chunked "
               "prefill)")
    dense_logits = np.asarray(dense(params, jnp.asarray(prompts), lens, scales, True)[0])
    # The cache state before decoding, for the verify step (the decode step donates its caches).
    spec_caches = jax.tree.map(jnp.copy, caches)
    spec_alloc = copy.deepcopy(alloc)
    last = np.asarray(prompt_lens) - 1
    forced = runs["bf16"]["tokens"][:, :-1] if cfg.teacher_force else None
    runs["nvfp4"] = decode(cfg, "nvfp4", params, caches, alloc,
                           chunk_logits[np.arange(cfg.batch), last], scales, trace_counter,
                           forced_tokens=forced)
    del caches

    # Speculative decoding: the tokens the NVFP4 decode consumed in its first k steps (its own
    # greedy tokens: the model drafts for itself; with --teacher-force the bf16 run's) verified
    # in one step from the cache state before them.
    fed = runs["bf16"]["tokens"] if cfg.teacher_force else runs["nvfp4"]["tokens"]
    stage(cfg, f"nvfp4: speculative verify step, {k} tokens per sequence")
    verify = make_ragged_step(cfg, trace_counter, max_q_len=k, name="verify")
    verify_logits = verify_step(cfg, params, spec_caches, spec_alloc, scales, verify,
                                fed[:, :k], cfg.batch * k)
    del spec_caches
    bounds = match_bounds(cfg, platform)

    valid = np.arange(prompts.shape[1])[None, :] < np.asarray(prompt_lens)[:, None]
    pdiff = np.abs(chunk_logits - dense_logits)[valid]
    p_same = chunk_logits.argmax(-1)[valid] == dense_logits.argmax(-1)[valid]
    chunked = dict(
        chunk=cfg.prefill_chunk, **chunk_info, positions=int(valid.sum()),
        max_abs_diff=float(pdiff.max()), mean_abs_diff=float(pdiff.mean()),
        mean_abs_logit=float(np.abs(dense_logits[valid]).mean()),
        argmax_same=int(p_same.sum()), bound=bounds["prefill"], bound_measured=bounds["measured"],
        traces=trace_counter["ragged"], jit_cache_size=ragged._cache_size(),
        logits=chunk_logits, dense_logits=dense_logits,
        path=_ragged_path(cfg, platform))
    chunked["passed"] = bool(np.isfinite(pdiff).all() and chunked["max_abs_diff"]
                             <= chunked["bound"])
    step_logits = runs["nvfp4"]["logits"][:, :k]
    sdiff = np.abs(verify_logits - step_logits)
    s_same = verify_logits.argmax(-1) == step_logits.argmax(-1)
    accepted = _leading_true(verify_logits.argmax(-1) == fed[:, 1:k + 1])
    spec = dict(draft_tokens=k, tokens=fed[:, :k], drafts=fed[:, 1:k + 1],
                logits=verify_logits, max_abs_diff=float(sdiff.max()),
                mean_abs_diff=float(sdiff.mean()), argmax_same=int(s_same.sum()),
                positions=int(s_same.size), accepted=accepted.tolist(),
                bound=bounds["verify"], bound_measured=bounds["measured"], path=chunked["path"],
                max_q_len=k, traces=trace_counter["verify"])
    # Equal to the steps within the bound and the same greedy choice at every position: the
    # model drafting for itself has every draft accepted.
    spec["passed"] = bool(np.isfinite(sdiff).all() and spec["max_abs_diff"] <= spec["bound"]
                          and spec["argmax_same"] == spec["positions"])

    # Compare with the bf16 run. Token 0 comes from each run's prefill (the last prompt
    # position), token i + 1 from decode step i.
    a, b = runs["nvfp4"], runs["bf16"]
    logits_a = np.concatenate([a["first_logits"][:, None], a["logits"]], axis=1)
    logits_b = np.concatenate([b["first_logits"][:, None], b["logits"]], axis=1)
    same = a["tokens"] == b["tokens"]                        # [B, steps + 1]
    first_divergence = np.where(same.all(1), cfg.steps + 1, np.argmin(same, axis=1))
    if cfg.teacher_force:   # same inputs at every step: compare each step's greedy choice
        comparable = np.ones_like(same)
    else:                   # free-running: the histories match up to the first difference
        comparable = np.arange(cfg.steps + 1)[None, :] <= first_divergence[:, None]
    diff = np.abs(logits_a - logits_b)[comparable]
    kl = _kl(logits_b[comparable], logits_a[comparable])   # KL(bf16 run || NVFP4 run)
    top2 = np.sort(logits_b[comparable], axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]          # how close the bf16 run's greedy choices were
    results = dict(
        config=dataclasses.asdict(cfg),
        device=str(_default_device()),
        platform=platform,
        prompt_lens=prompt_lens,
        prompts=prompts,
        tokens_nvfp4=a["tokens"], tokens_bf16=b["tokens"],     # [B, steps + 1]
        logits_nvfp4=logits_a, logits_bf16=logits_b,           # [B, steps + 1, vocab]
        agreement=float(same.mean()),
        # Greedy choices made from identical inputs that agree (equals agreement when
        # teacher-forced; free-running: every token up to and including the first difference).
        step_agreement=float(same[comparable].mean()),
        first_divergence=first_divergence.tolist(),
        logits_max_abs_diff=float(diff.max()),
        logits_mean_abs_diff=float(diff.mean()),
        logits_mean_abs=float(np.abs(logits_b).mean()),
        logits_kl_mean=float(kl.mean()),
        model=model_note,
        prompt_sources=sources,
        continuations=truths,            # the held-out text that follows each prompt
        logits_compared_steps=int(comparable.sum()),
        bf16_top2_margin_median=float(np.median(margin)),
        chunked_prefill=chunked,
        speculative=spec,
        checks_passed=chunked["passed"] and spec["passed"],
        tokens_per_s={k: r["tokens_per_s"] for k, r in runs.items()},
        first_step_s={k: r["first_step_s"] for k, r in runs.items()},
        cache_bytes={k: r["cache_bytes"] for k, r in runs.items()},
        cache_ratio=b["cache_bytes"] / a["cache_bytes"],
        bytes_per_token={k: cfg.layers * bytes_per_token_per_layer(cfg, k) for k in KINDS},
        traces={k: r["traces"] for k, r in runs.items()},
        jit_cache_size={k: r["jit_cache_size"] for k, r in runs.items()},
        caches_donated={k: r["caches_donated"] for k, r in runs.items()},
        hlo_aliased_outputs={k: r["hlo_aliased_outputs"] for k, r in runs.items()},
        hlo_cache_copies={k: r["hlo_cache_copies"] for k, r in runs.items()},
        cache_leaves={k: r["cache_leaves"] for k, r in runs.items()},
        k_scales=[float(s[0]) for s in scales], v_scales=[float(s[1]) for s in scales],
        num_blocks=num_blocks,
    )
    results["wall_s"] = time.perf_counter() - t_start
    if cfg.report:
        report(cfg, results)
    return results


def load_model(cfg):
    """``(params, description)``: the trained model (float32, from examples/tiny_lm.npz) or,
    with ``cfg.random_weights``, random seeded bf16 weights of ``cfg``'s sizes."""
    if cfg.random_weights:
        return init_params(cfg), "random weights"
    shape, params, meta = tiny_lm.load_weights()
    if shape != tiny_lm.model_config(cfg):
        raise ValueError(f"the trained model has the sizes {shape}; other sizes need "
                         f"--random-weights")
    return params, (f"trained byte-level model, {tiny_lm.num_params(params) / 1e6:.1f}M "
                    f"parameters, {meta['heldout_bits_per_byte']:.3f} bits/byte on held-out "
                    f"text")


def text_prompts(prompt_lens, continuation):
    """Prompts of held-out standard-library text (examples/stdlib_corpus.py), one file each,
    spread over the held-out files, each starting at the first line start a third of the way
    into its file. Returns ``(prompts [B, max len] int32, file paths, the ``continuation``
    bytes that follow each prompt)``."""
    split = stdlib_corpus.load_split(heldout=True)
    need = max(prompt_lens) + continuation
    starts = {}
    for i, text in enumerate(split.texts):
        start = text.find(b"\n", len(text) // 3) + 1
        if start > 0 and start + need <= len(text):
            starts[i] = start
    files = list(starts)
    picks = [files[j] for j in np.linspace(0, len(files) - 1, len(prompt_lens)).astype(int)]
    prompts = np.zeros((len(prompt_lens), max(prompt_lens)), np.int32)
    truths = []
    for b, (i, n) in enumerate(zip(picks, prompt_lens)):
        text = np.frombuffer(split.texts[i], np.uint8)[starts[i]:]
        prompts[b, :n] = text[:n]
        truths.append(bytes(text[n:n + continuation]))
    return prompts, [split.paths[i] for i in picks], truths


def _kl(p_logits, q_logits):
    """KL(p || q) in nats of the softmaxes of two logit arrays [..., vocab], per row."""
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def _show(data: bytes, width=None) -> str:
    """Bytes as one printable line: UTF-8 (undecodable bytes replaced), escapes visible."""
    text = data.decode("utf-8", errors="replace")
    if width is not None and len(text) > width:
        text = "..." + text[-width:]
    return repr(text)


def _default_device():
    """Where this run's arrays are placed: ``jax.default_device`` when one is set (the tests
    set the CPU), else JAX's first device."""
    return next(iter(jnp.zeros(()).devices()))


def _reader_note(cfg, platform):
    if platform == "gpu" and _ffi_has_cuda():
        note = "  NVFP4 attention ran the fused CUDA kernel"
        if cfg.random_weights:
            return note
        # Profiled on an H200 (benchmarks/RESULTS.md, "The example on the H200"): the trained
        # model's NVFP4 step takes ~0.7x the bf16 step's device time; with one step a call
        # both steps' wall time is the host's (dispatch and XLA's command-buffer update, once a
        # call). 200 steps, 2026-12-04: one step a call NVFP4 11,352 against bf16 17,510
        # tokens/s; 8 a call 33,340 against 25,107 (benchmarks/NOTES.md).
        if cfg.steps_per_call == 1:
            return (note + "; with one step a call a model this small is bound by the host's "
                    "dispatch, not by the cache: --steps-per-call N runs N steps a call (see "
                    "also --long-context and benchmarks/)")
        return (note + f"; {cfg.steps_per_call} steps a call, one host dispatch each (with "
                "one step a call a model this small is bound by the host, not by the cache)")
    return (f"  on {platform} the NVFP4 reader is the jnp path (it dequantises the pages it "
            f"reads; the fused CUDA kernel runs on a GPU), so these tokens/s say little about a "
            f"GPU: see --long-context and benchmarks/")


def _ffi_has_cuda():
    from jax_nvfp4 import _ffi

    return _ffi.built_with_cuda()


def report(cfg, r):
    """The verdict first (per cache: speed, bytes per token, how much context fits), then the
    agreement with the bf16 run; the run's internals with --verbose."""
    tps, bpt = r["tokens_per_s"], r["bytes_per_token"]
    ratio = bpt["bf16"] / bpt["nvfp4"]
    print(f"NVFP4 vs bf16 paged KV cache: {cfg.layers} layers, {cfg.num_kv_heads} kv heads x "
          f"{cfg.head_size}, batch {cfg.batch}, {cfg.steps} decode steps"
          + (f" ({cfg.steps_per_call} a call)" if cfg.steps_per_call > 1 else "")
          + f" on {r['platform']} ({r['model']})")
    print(f"  nvfp4: {tps['nvfp4']:8,.1f} tokens/s, {bpt['nvfp4']:6,} B of cache per token "
          f"-> {ratio:.2f}x the context of bf16 in the same memory")
    print(f"  bf16 : {tps['bf16']:8,.1f} tokens/s, {bpt['bf16']:6,} B of cache per token")
    print(_reader_note(cfg, r["platform"]))
    forced = cfg.teacher_force
    compared = ("every step of every sequence" if forced else
                "each sequence's tokens up to and including its first difference, where both "
                "runs had the same history")
    print(f"agreement: {100 * r['step_agreement']:.1f}% of greedy next tokens match the bf16 "
          f"run given the same history ({r['logits_compared_steps']} sequence-steps: "
          f"{compared}); "
          f"KL(bf16 || NVFP4) mean {r['logits_kl_mean']:.2g} nats; "
          f"logits |NVFP4 - bf16| mean {r['logits_mean_abs_diff']:.4f}, max "
          f"{r['logits_max_abs_diff']:.4f} (mean |logit| {r['logits_mean_abs']:.3f})")
    generated = len(r["first_divergence"]) * (cfg.steps + 1)
    share = (f"{100 * r['agreement']:.1f}% of the {generated} generated tokens equal the bf16 "
             f"run's at the same position")
    if forced:
        print("  (teacher-forced: the NVFP4 run was fed the bf16 run's tokens, so every step "
              "compares choices made from identical inputs)")
    elif cfg.random_weights:
        print(f"  greedy-token agreement (free-running): {share}, lower "
              f"because random weights give near-ties (median bf16 top-1 - top-2 margin "
              f"{r['bf16_top2_margin_median']:.3f}), and once one token differs every later "
              f"input of that sequence differs too")
    else:
        n = cfg.steps + 1
        firsts = [f for f in r["first_divergence"] if f < n]
        where = (f"sequences first differ at generated token {', '.join(map(str, sorted(firsts)))}"
                 f" of 0..{cfg.steps}" if firsts else f"no sequence differs in {n} tokens")
        print(f"  greedy-token agreement (free-running): {share} ({where}; "
              f"after a first difference every later input of that sequence differs too); "
              f"benchmarks/quality_bench.py measures the cost in bits per byte")
    report_checks(cfg, r)
    if r["prompt_sources"] is not None:
        report_samples(cfg, r)
    if not cfg.verbose:
        return
    print(f"device: {r['device']}")
    print(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.num_q_heads} q heads / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_size}, mlp {cfg.mlp}, vocab {cfg.vocab} "
          f"({r['model']})")
    print(f"batch {cfg.batch}, prompt lengths {r['prompt_lens']}, {cfg.steps} decode steps, "
          f"block_size {cfg.block_size}, {r['num_blocks']} pages, layout {cfg.layout}, "
          f"scale_search {cfg.scale_search}")
    print("k_scale per layer: " + ", ".join(f"{s:.4g}" for s in r["k_scales"])
          + "; v_scale: " + ", ".join(f"{s:.4g}" for s in r["v_scales"]))
    for k in KINDS:
        first = "first step" if cfg.steps_per_call == 1 else f"first {cfg.steps_per_call} steps"
        print(f"{k:>5}: {first} incl. compile {r['first_step_s'][k]:.2f} s, cache "
              f"{r['cache_bytes'][k]:,} bytes, step traced {r['traces'][k]}x, jit cache entries "
              f"{r['jit_cache_size'][k]}, caches donated {r['caches_donated'][k]}, aliased "
              f"outputs {r['hlo_aliased_outputs'][k]}/{r['cache_leaves'][k] + 1} (the caches' "
              f"and seq_lens), cache copies in "
              f"HLO {r['hlo_cache_copies'][k]}")
    c = r["chunked_prefill"]
    print(f"prefill: bf16 run dense (the prompts' K/V stored at once: a bf16 cache has no "
          f"ragged reader); nvfp4 run chunked, {c['steps']} ragged steps of {c['num_tokens']} "
          f"packed tokens (query tokens per step {c['tokens_per_step']}, sequences per step "
          f"{c['seqs_per_step']}), first step incl. compile {c['first_step_s']:.2f} s, "
          f"{c['seconds']:.2f} s in all, ragged step traced {c['traces']}x, "
          f"jit cache entries {c['jit_cache_size']}, caches donated {c['caches_donated']}, "
          f"ragged attention: {c['path']} path")
    print(f"first differing generated token per sequence: {r['first_divergence']} (token 0 from "
          f"the prefill; {cfg.steps + 1}: none)")
    for b in range(min(cfg.batch, 4)):
        print(f"  seq {b} bf16 : {r['tokens_bf16'][b, :12].tolist()}")
        print(f"  seq {b} nvfp4: {r['tokens_nvfp4'][b, :12].tolist()}")
    print(f"wall time {r['wall_s']:.1f} s")


def _bound_note(check) -> str:
    return "" if check["bound_measured"] else (
        ", a provisional bound: the CUDA ragged kernel's error is not measured for this model yet")


def report_checks(cfg, r):
    """The chunked-prefill and speculative-decoding checks, one line each; a check that fails
    says FAILED (and the script exits with status 1)."""
    c, s = r["chunked_prefill"], r["speculative"]
    chunks = sorted(set(c["chunks_per_prompt"]))
    each = (f"{chunks[0]}" if len(chunks) == 1 else f"{chunks[0]} to {chunks[-1]}")
    how = (f"{cfg.batch} prompts through the NVFP4 cache {c['chunk']} tokens at a time ({each} "
           f"chunks each, {c['steps']} ragged steps)")
    stats = (f"max |diff| {c['max_abs_diff']:.2g}, mean {c['mean_abs_diff']:.2g} (mean |logit| "
             f"{c['mean_abs_logit']:.3g}), same argmax at {c['argmax_same']}/{c['positions']}")
    if c["passed"]:
        print(f"chunked prefill: {how}: logits match the dense prefill (K/V through NVFP4) "
              f"within {c['bound']:.3g} at all {c['positions']} prompt positions: {stats}"
              f"{_bound_note(c)}")
    else:
        print(f"chunked prefill: FAILED: {how}: logits differ from the dense prefill (K/V "
              f"through NVFP4) by more than {c['bound']:.3g} over the {c['positions']} prompt "
              f"positions: {stats}{_bound_note(c)}")
    k = s["draft_tokens"]
    acc = s["accepted"]
    if cfg.teacher_force:
        drafts = (f"drafts = the bf16 run's tokens (--teacher-force), accepted per sequence: "
                  f"{', '.join(map(str, acc))} of {k}")
    elif min(acc) == k:
        drafts = f"the model drafting for itself: {k}/{k} drafts accepted in every sequence"
    else:
        drafts = (f"the model drafting for itself: drafts accepted per sequence "
                  f"{', '.join(map(str, acc))} of {k}"
                  + (" (a tie closer than the difference)" if s["passed"] else ""))
    how = f"one verify step of {k} tokens per sequence (max_q_len={s['max_q_len']})"
    stats = (f"max |diff| {s['max_abs_diff']:.2g}, same argmax at {s['argmax_same']}/"
             f"{s['positions']} positions; {drafts}")
    if s["passed"]:
        print(f"speculative decoding: {how} equals {k} token-by-token decode steps within "
              f"{s['bound']:.3g}: {stats}{_bound_note(s)}")
    else:
        print(f"speculative decoding: FAILED: {how} differs from {k} token-by-token decode "
              f"steps by more than {s['bound']:.3g}: {stats}{_bound_note(s)}")


def report_samples(cfg, r):
    """The generated text of both runs under the end of each prompt."""
    print(f"generated text (greedy, {cfg.steps + 1} bytes after a prompt of held-out text the "
          f"model was not trained on):")
    for b, path in enumerate(r["prompt_sources"]):
        n = r["prompt_lens"][b]
        runs = {k: bytes(r[f"tokens_{k}"][b].astype(np.uint8)) for k in KINDS}
        same = "same" if runs["nvfp4"] == runs["bf16"] else (
            f"same first {r['first_divergence'][b]} bytes")
        print(f"  [{b}] {path}, prompt ({n} bytes) ends {_show(bytes(r['prompts'][b, :n].astype(np.uint8)), 40)}")
        print(f"      text : {_show(r['continuations'][b])}")
        print(f"      bf16 : {_show(runs['bf16'])}")
        note = ", each byte chosen after the bf16 run's bytes" if cfg.teacher_force else ""
        print(f"      nvfp4: {_show(runs['nvfp4'])}  ({same}{note})")


# --------------------------------------------------------------------------- long-context mode

#: E4M3 block-scale bytes of the random NVFP4 caches: 0x30 (0.5) to 0x58 (16), all finite
#: (0x7F and 0xFF are NaN).
RANDOM_SCALE_BYTES = (0x30, 0x58)
#: k_scale = v_scale of the random NVFP4 caches: |code * block scale * 1/32| <= 6 * 16 / 32 = 3,
#: about the range of the bf16 caches' standard normals.
RANDOM_KV_SCALE = 1.0 / 32.0
#: Variants the long-context mode times: name -> (cache kind, paged_attention impl).
LONG_CONTEXT_RUNS = {"nvfp4": ("nvfp4", "auto"), "bf16": ("bf16", "auto"),
                     "nvfp4_jnp": ("nvfp4", "jnp")}
LONG_CONTEXT_LABELS = {"nvfp4": "nvfp4", "bf16": "bf16", "nvfp4_jnp": "nvfp4 (impl=jnp)"}


def bytes_per_token_per_layer(cfg, kind) -> int:
    """Cache bytes one token takes in one layer, K and V together, from the shapes."""
    if kind == "nvfp4":
        return 2 * cfg.num_kv_heads * jax_nvfp4.head_bytes(cfg.head_size)
    return 2 * cfg.num_kv_heads * cfg.head_size * np.dtype(jnp.bfloat16).itemsize


def long_context_plan(cfg, num_new: int, seed: int):
    """Page pool and per-step inputs: ``cfg.batch`` sequences that hold ``cfg.context`` tokens
    each, then decode ``num_new`` more.

    Every sequence owns ``ceil((context + num_new) / block_size)`` pages and the pool is exactly
    ``batch`` times that (the last few pages of each row take the new tokens). The block tables
    are one random permutation of all pages cut into rows, so a sequence's pages are scattered.
    Step ``i`` stores the token at position ``context + i`` and attends to ``context + i + 1``.

    Returns ``(num_blocks, block_tables [batch, pages], seq_lens [num_new, batch])``, NumPy
    int32; step ``i``'s slots are ``decode_slots(block_tables, seq_lens[i], block_size)``, as the
    decode step computes them.
    """
    if cfg.context < 0 or num_new < 1:
        raise ValueError(f"context must be >= 0 and num_new >= 1, got {cfg.context}, {num_new}")
    bs = cfg.block_size
    pages = -(-(cfg.context + num_new) // bs)
    num_blocks = cfg.batch * pages
    tables = (np.random.default_rng(seed).permutation(num_blocks)
              .reshape(cfg.batch, pages).astype(np.int32))
    pos = cfg.context + np.arange(num_new)                              # [num_new]
    lens = np.broadcast_to(pos[:, None] + 1, (num_new, cfg.batch)).astype(np.int32)
    return num_blocks, tables, lens


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_nvfp4_cache(key, shape, layout):
    geo = jax_nvfp4.layout.CacheGeometry.from_shape(shape, layout)
    lo, hi = RANDOM_SCALE_BYTES
    k_codes, k_scales = jax.random.split(key)
    codes = jax.random.bits(k_codes, (geo.num_blocks, 2, geo.side_data_bytes), jnp.uint8)
    scales = jax.random.randint(k_scales, (geo.num_blocks, 2, geo.side_bytes - geo.side_data_bytes),
                                lo, hi + 1, jnp.uint8)
    return jnp.concatenate([codes, scales], axis=-1).reshape(shape)


@functools.partial(jax.jit, static_argnums=1)
def _random_bf16_cache(key, shape):
    return tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key))


def random_caches(cfg, kind, num_blocks, key):
    """Per-layer caches full of random valid values, made on the device (no prefill).

    NVFP4: each (page, side) is a region of packed FP4 codes followed by a region of E4M3 block
    scales (:class:`jax_nvfp4.layout.CacheGeometry`); codes are random bytes (every E2M1 code is
    a finite value), scales random bytes in ``RANDOM_SCALE_BYTES``. bf16: standard normals
    (K and V).
    """
    keys = jax.random.split(key, cfg.layers)
    if kind == "nvfp4":
        shape = jax_nvfp4.kv_cache_shape(num_blocks, cfg.block_size, cfg.num_kv_heads,
                                         cfg.head_size, cfg.layout)
        return tuple(_random_nvfp4_cache(k, shape, cfg.layout) for k in keys)
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
    return tuple(_random_bf16_cache(k, shape) for k in keys)


def time_long_context(cfg, kind, params, plan, impl="auto"):
    """Fills one kind of cache, compiles the decode step and times it. Returns a dict."""
    num_blocks, tables, lens = plan               # (the step finds its slots)
    label = LONG_CONTEXT_LABELS[next(n for n, v in LONG_CONTEXT_RUNS.items() if v == (kind, impl))]
    stage(cfg, f"{label}: filling {cfg.layers} layers' caches with random values on the device")
    t0 = time.perf_counter()
    caches = random_caches(cfg, kind, num_blocks, jax.random.PRNGKey(cfg.seed + 2))
    jax.block_until_ready(caches)
    fill_s = time.perf_counter() - t0
    device = next(iter(jax.tree.leaves(caches)[0].devices()))
    bpt = bytes_per_token_per_layer(cfg, kind)
    total_bytes = cache_bytes(caches)
    if total_bytes != num_blocks * cfg.block_size * cfg.layers * bpt:
        raise AssertionError(f"{kind} cache holds {total_bytes} bytes, expected "
                             f"{num_blocks} pages x {cfg.block_size} x {cfg.layers} x {bpt}")
    if kind == "nvfp4":
        scale = jnp.asarray(RANDOM_KV_SCALE, jnp.float32)
        scales = tuple((scale, scale) for _ in range(cfg.layers))
    else:
        scales = tuple(() for _ in range(cfg.layers))
    step = make_decode_step(cfg, kind, {kind: 0}, impl=impl)
    tokens = jax.random.randint(jax.random.PRNGKey(cfg.seed + 3), (cfg.batch,), 0, cfg.vocab,
                                jnp.int32)
    # On the device before timing: the block tables (every step's page in them) and the first
    # step's lengths; each step returns the next step's (its slots follow from the two).
    tables_d = jnp.asarray(tables)
    lens_d = jnp.asarray(lens[0])

    k = cfg.steps_per_call
    stage(cfg, f"{label}: compiling the decode step" + (f" ({k} steps a call)" if k > 1 else ""))
    t0 = time.perf_counter()
    compiled = step.lower(*decode_step_args(k, params, caches, scales, tokens, tables_d,
                                            lens_d)).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    kernel_calls = hlo.count(f'custom_call_target="{_DECODE_TARGET}"')
    cache_copies = _hlo_cache_copies(hlo, caches)

    def call(caches, tokens, lens_d):
        """One call: k steps; returns the state and the logits ([B, vocab], or [k, B, vocab]
        for k > 1: reshaped on the host, so the timed loop dispatches nothing more)."""
        caches, lens_d, tokens, _, logits = decode_step_outputs(k, compiled(
            *decode_step_args(k, params, caches, scales, tokens, tables_d, lens_d)))
        return caches, tokens, lens_d, logits

    # Call 0 (warm-up): checks donation and keeps its first step's logits (the same in every
    # NVFP4 run).
    old = caches
    caches, tokens, lens_d, logits = call(caches, tokens, lens_d)
    first_logits = np.asarray(logits).reshape(-1, *tokens.shape, cfg.vocab)[0]
    donated = all(x.is_deleted() for x in jax.tree.leaves(old))
    del old
    i = k
    for _ in range(cfg.warmup - 1):
        caches, tokens, lens_d, logits = call(caches, tokens, lens_d)
        i += k
    jax.block_until_ready((tokens, logits, caches))

    times, attended = [], []
    progress = Progress(cfg.repeats, f"{label}: timed runs of {cfg.steps} steps", cfg.progress)
    for _ in range(cfg.repeats):
        attended.append(lens[i:i + cfg.steps].sum(dtype=np.int64))
        t0 = time.perf_counter()
        for _ in range(cfg.steps // k):
            caches, tokens, lens_d, logits = call(caches, tokens, lens_d)
            i += k
        jax.block_until_ready((tokens, logits, caches))
        times.append((time.perf_counter() - t0) / cfg.steps)
        progress.update()
    progress.close()
    last_logits = np.asarray(logits).reshape(-1, *tokens.shape, cfg.vocab)[-1]
    del caches
    step_s = float(np.median(times))
    # Bytes of the tokens attended to (K and V, all layers) over the time taken: the kernel
    # reads about this much; the jnp readers gather every page of the block tables.
    attended_bytes = float(np.mean(attended)) / cfg.steps * cfg.layers * bpt
    return dict(
        device=str(device), platform=device.platform, impl=impl,
        attention_kernel_calls=kernel_calls,
        attention_path="kernel" if kernel_calls else "jnp",
        step_ms=1e3 * step_s, step_ms_all=[1e3 * t for t in times],
        tokens_per_s=cfg.batch / step_s, attended_gb_per_s=attended_bytes / step_s / 1e9,
        compile_s=compile_s, fill_s=fill_s, cache_bytes=total_bytes,
        bytes_per_token_per_layer=bpt, caches_donated=donated, hlo_cache_copies=cache_copies,
        steps_run=i, first_logits=first_logits, last_logits=last_logits,
        logits_finite=bool(np.isfinite(first_logits).all() and np.isfinite(last_logits).all()),
    )


def run_long_context(cfg: Config) -> dict:
    """Times one decode step over caches already holding ``cfg.context`` tokens per sequence:
    NVFP4 (fused CUDA kernel on a GPU) against bf16. Returns a results dict."""
    t_start = time.perf_counter()
    _check_config(dataclasses.replace(cfg, long_context=True))
    num_new = cfg.warmup * cfg.steps_per_call + cfg.repeats * cfg.steps
    plan = long_context_plan(cfg, num_new, seed=cfg.seed + 1)
    num_blocks, tables = plan[:2]
    params = init_params(cfg)
    names = ("nvfp4", "bf16") + (("nvfp4_jnp",) if cfg.nvfp4_jnp else ())
    runs = {}
    for name in names:                  # one kind of cache in memory at a time
        kind, impl = LONG_CONTEXT_RUNS[name]
        runs[name] = time_long_context(cfg, kind, params, plan, impl)
    a, b = runs["nvfp4"], runs["bf16"]
    bf16_bytes = b["cache_bytes"]
    tokens_in_bf16_memory = {k: bf16_bytes // (cfg.layers * runs[k]["bytes_per_token_per_layer"])
                             for k in ("nvfp4", "bf16")}
    results = dict(
        config=dataclasses.asdict(cfg),
        device=a["device"], platform=a["platform"],
        num_blocks=num_blocks, pages_per_seq=tables.shape[1], new_tokens=num_new,
        runs=runs,
        step_ms={k: r["step_ms"] for k, r in runs.items()},
        tokens_per_s={k: r["tokens_per_s"] for k, r in runs.items()},
        attention_path={k: r["attention_path"] for k, r in runs.items()},
        speedup=b["step_ms"] / a["step_ms"],
        bytes_per_token_per_layer={k: runs[k]["bytes_per_token_per_layer"]
                                   for k in ("nvfp4", "bf16")},
        cache_bytes={k: runs[k]["cache_bytes"] for k in ("nvfp4", "bf16")},
        capacity_ratio=b["bytes_per_token_per_layer"] / a["bytes_per_token_per_layer"],
        tokens_in_bf16_memory=tokens_in_bf16_memory,
    )
    if "nvfp4_jnp" in runs:
        j = runs["nvfp4_jnp"]
        diff = np.abs(a["first_logits"] - j["first_logits"])
        results.update(
            kernel_speedup=j["step_ms"] / a["step_ms"],
            kernel_vs_jnp_logits_max_abs_diff=float(diff.max()),
            kernel_vs_jnp_logits_mean_abs=float(np.abs(j["first_logits"]).mean()),
            kernel_vs_jnp_greedy_agreement=float(
                (a["first_logits"].argmax(-1) == j["first_logits"].argmax(-1)).mean()))
    results["wall_s"] = time.perf_counter() - t_start
    if cfg.report:
        report_long_context(cfg, results)
    return results


def _fmt_bytes(n) -> str:
    """Decimal units: 4.84 GB, 23.0 kB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_rate(x) -> str:
    """Three significant digits or more: 4,012, 1.23, 0.000123."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def report_long_context(cfg, r):
    """The verdict first (per cache: tokens/s, bytes per token, how much context fits; the
    speed-up), then with --verbose how it was measured."""
    runs = r["runs"]
    bpt = r["bytes_per_token_per_layer"]
    fit = r["tokens_in_bf16_memory"]
    per_seq = cfg.context + r["new_tokens"]
    print(f"long context: batch {cfg.batch} x {cfg.context:,} tokens already in the cache, "
          f"{cfg.layers} layers of {cfg.num_q_heads} q / {cfg.num_kv_heads} kv heads x "
          f"{cfg.head_size}, on {r['platform']}")
    width = max(len(LONG_CONTEXT_LABELS[k]) for k in runs)
    for name, run in runs.items():
        kind = LONG_CONTEXT_RUNS[name][0]
        line = (f"  {LONG_CONTEXT_LABELS[name]:<{width}}: {run['tokens_per_s']:10,.1f} tokens/s "
                f"(step {run['step_ms']:.3f} ms), {cfg.layers * bpt[kind]:,} B of cache per "
                f"token")
        if name == "nvfp4":
            line += (f" -> {r['capacity_ratio']:.2f}x the context of bf16 in the same memory")
        print(line)
    print(f"speed-up NVFP4 over bf16 (bf16 step time / NVFP4 step time): {r['speedup']:.2f}x "
          f"({r['step_ms']['bf16']:.3f} ms / {r['step_ms']['nvfp4']:.3f} ms; NVFP4 attention: "
          f"{runs['nvfp4']['attention_path']} path)")
    if "kernel_speedup" in r:
        print(f"same NVFP4 cache, impl=auto over impl=jnp: {r['kernel_speedup']:.2f}x; first "
              f"step logits max |diff| {r['kernel_vs_jnp_logits_max_abs_diff']:.4f} (mean "
              f"|logit| {r['kernel_vs_jnp_logits_mean_abs']:.3f}), greedy agreement "
              f"{100 * r['kernel_vs_jnp_greedy_agreement']:.1f}%")
    print(f"same memory: the bf16 caches' {_fmt_bytes(r['cache_bytes']['bf16'])} hold "
          f"{fit['nvfp4']:,} tokens in NVFP4 against {fit['bf16']:,} in bf16: "
          f"{r['capacity_ratio']:.2f}x as many (+{100 * (r['capacity_ratio'] - 1):.0f}%), "
          f"{fit['nvfp4'] // per_seq:,} sequences of {per_seq:,} tokens instead of "
          f"{fit['bf16'] // per_seq:,}")
    if runs["nvfp4"]["attention_path"] != "kernel":
        print(f"  (the NVFP4 step ran the jnp path on platform {r['platform']}: the fused "
              f"kernel needs a GPU, a CUDA build of jax_nvfp4 and head size in "
              f"{_KERNEL_HEAD_SIZES}; the numbers above are not the kernel's)")
    if not cfg.verbose:
        return
    print(f"device: {r['device']} (platform {r['platform']})")
    print(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.num_q_heads} q heads / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_size}, mlp {cfg.mlp}, vocab {cfg.vocab} "
          f"(random weights)")
    context_pages = -(-cfg.context // cfg.block_size)
    print(f"caches: random values made on the device (no prefill), block_size "
          f"{cfg.block_size}, layout {cfg.layout}")
    print(f"page pool: {r['num_blocks']:,} pages = {cfg.batch} sequences x "
          f"{r['pages_per_seq']:,} pages ({context_pages:,} hold the context, the rest the "
          f"{r['new_tokens']} new tokens); block tables: a random permutation of the pages")
    k = cfg.steps_per_call
    warm = f"{cfg.warmup} warm-up " + (f"calls of {k} steps" if k > 1 else "steps")
    print(f"timing: {warm} after compiling, then the median of "
          f"{cfg.repeats} runs of {cfg.steps} steps" + (f" ({k} a call)" if k > 1 else "")
          + " (block_until_ready after each run); "
          f"one step = all layers (q/k/v, store into the donated cache, attend, MLP)")
    paths = []
    for name, run in runs.items():
        if run["attention_path"] == "kernel":
            what = (f"fused CUDA kernel ({run['attention_kernel_calls']} {_DECODE_TARGET} "
                    f"custom calls in the compiled step, {cfg.layers} layers)")
        elif name == "bf16":
            what = ("jnp path (paged_attention_bf16: page gather + XLA attention; there is "
                    "no fused bf16 kernel here)")
        else:
            what = f"{run['attention_path']} path (paged_attention impl={run['impl']})"
        paths.append(f"{LONG_CONTEXT_LABELS[name]} -> {what}")
    print("attention: " + "; ".join(paths))
    for name, run in runs.items():
        ms = run["step_ms_all"]
        print(f"{LONG_CONTEXT_LABELS[name]:>{width}}: step {run['step_ms']:.3f} ms (median; "
              f"min {min(ms):.3f}, max {max(ms):.3f}), {run['tokens_per_s']:,.1f} tokens/s, "
              f"attended KV {_fmt_rate(run['attended_gb_per_s'])} GB/s, compile "
              f"{run['compile_s']:.2f} s, cache {_fmt_bytes(run['cache_bytes'])}, caches "
              f"donated {run['caches_donated']}, cache copies in HLO {run['hlo_cache_copies']}")
    hb = jax_nvfp4.head_bytes(cfg.head_size)
    print(f"cache bytes per token per layer: NVFP4 {bpt['nvfp4']:,} (2 x {cfg.num_kv_heads} kv "
          f"heads x {hb} B) vs bf16 {bpt['bf16']:,} (2 x {cfg.num_kv_heads} kv heads x "
          f"{cfg.head_size} x 2 B): {r['capacity_ratio']:.2f}x smaller")
    print(f"total cache ({cfg.layers} layers, {r['num_blocks']:,} pages): NVFP4 "
          f"{_fmt_bytes(r['cache_bytes']['nvfp4'])} vs bf16 {_fmt_bytes(r['cache_bytes']['bf16'])}")
    print(f"wall time {r['wall_s']:.1f} s")


def _check_config(cfg: Config):
    """:func:`config_problems` for a caller that built ``cfg`` itself (the command line has
    :func:`parse_args`): ValueError naming every problem; the layout and scale search too."""
    jax_nvfp4.layout.check_layout(cfg.layout)
    jax_nvfp4.layout.check_scale_search(cfg.scale_search)
    problems = config_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))


#: The most decode steps a call that the command line picks by itself (``--steps-per-call``
#: not given). On an H200 the trained model's NVFP4 decode ran at 0.65x the bf16 decode's
#: tokens/s with one step a call and at 1.33x with 8 (200 steps, 2026-12-04): a step of this
#: model is bound by the host's dispatch, and a call of 8 steps pays it once
#: (benchmarks/NOTES.md, "The example's decode step").
AUTO_MAX_STEPS_PER_CALL = 8


def auto_steps_per_call(steps: int) -> int:
    """``--steps-per-call`` when the command line does not give it, outside ``--long-context``
    (whose default is 1): the largest N <= 8 that divides ``steps`` and is at most half of it
    (the first call compiles and is not timed); 1 if no larger N does. (``--long-context``'s
    model is large enough for its step not to be the host's: 2.436 ms a step at one step a
    call, 2.380 at 10, H200.)"""
    return max((n for n in range(1, AUTO_MAX_STEPS_PER_CALL + 1)
                if n <= steps // 2 and steps % n == 0), default=1)


def config_problems(cfg: Config) -> list:
    """What is wrong with a configuration, one message per problem (empty: it runs)."""
    problems = []
    at_least = dict(batch=1, steps=1, prefill_chunk=1, draft_tokens=1, layers=1, d_model=1,
                    num_q_heads=1, num_kv_heads=1, mlp=1, vocab=1, extra_blocks=0, context=0,
                    repeats=1, warmup=1 if cfg.long_context else 0, steps_per_call=1)
    for name, low in at_least.items():
        if getattr(cfg, name) < low:
            problems.append(f"--{name.replace('_', '-')} must be >= {low}, got "
                            f"{getattr(cfg, name)}")
    if cfg.steps >= 1 and cfg.steps_per_call >= 1 and cfg.steps % cfg.steps_per_call:
        problems.append(f"--steps ({cfg.steps}) must be a multiple of --steps-per-call "
                        f"({cfg.steps_per_call}): every call runs that many steps")
    elif cfg.steps_per_call > 1 and cfg.steps < 2 * cfg.steps_per_call and not cfg.long_context:
        problems.append(f"--steps ({cfg.steps}) must be at least twice --steps-per-call "
                        f"({cfg.steps_per_call}): the first call, which compiles, is not timed")
    if not cfg.prompt_lens or min(cfg.prompt_lens) < 1:
        problems.append(f"--prompt-lens must all be >= 1, got {list(cfg.prompt_lens)}")
    if cfg.num_q_heads >= 1 and cfg.num_kv_heads >= 1 and cfg.num_q_heads % cfg.num_kv_heads:
        problems.append(f"--num-q-heads ({cfg.num_q_heads}) must be a multiple of "
                        f"--num-kv-heads ({cfg.num_kv_heads}) (grouped-query attention)")
    if cfg.block_size < 1 or cfg.block_size % 4:
        problems.append(f"--block-size must be a positive multiple of 4 (the NVFP4 page "
                        f"layout), got {cfg.block_size}")
    if cfg.head_size < 1 or cfg.head_size % 64:
        problems.append(f"--head-size must be a positive multiple of 64, got {cfg.head_size}: "
                        f"this example stores V scales swizzled, which needs head_size % 64 == 0 "
                        f"(other multiples of 16 need v_scale_swizzle=False)")
    return problems


def parse_args(argv=None) -> Config:
    """The command line as a :class:`Config`; a configuration that cannot run exits with a
    usage message naming the option (argparse's ``error``, exit status 2)."""
    d = Config()
    # Options whose default --long-context changes default to None here and are resolved below.
    long_default = {k: f" ({v} with --long-context)" for k, v in LONG_CONTEXT_DEFAULTS.items()
                    if v != getattr(d, k)}

    def sized(name, help_text, parser=None):
        field = name.lstrip("-").replace("-", "_")
        default = getattr(d, field)
        (parser or p).add_argument(
            name, type=int, default=None, metavar="N",
            help=f"{help_text} (default {default}{long_default.get(field, '')})")

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: python examples/paged_decode.py --batch 8 --prompt-lens 5 60 130 "
               "--steps 64 --layout NHD")
    sized("--batch", "sequences decoded together")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=list(d.prompt_lens),
                   metavar="N", help=f"prompt lengths in tokens, cycled over the batch (default "
                                     f"{' '.join(map(str, d.prompt_lens))})")
    sized("--steps", "decode steps (with --long-context: timed steps per repeat)")
    p.add_argument("--steps-per-call", type=int, default=None, metavar="N",
                   help=f"decode steps per jitted call, run on the device as a lax.scan (one "
                        f"host dispatch for N tokens a sequence; --steps a multiple of it; with "
                        f"--long-context --warmup counts calls) (default: the largest N <= "
                        f"{AUTO_MAX_STEPS_PER_CALL} that divides --steps and is at most half of "
                        f"it, {auto_steps_per_call(d.steps)} for the default {d.steps} steps; "
                        f"{d.steps_per_call} with --long-context)")
    sized("--prefill-chunk", "prompt tokens per sequence in each chunked-prefill step of the "
                             "NVFP4 run")
    sized("--draft-tokens", "tokens per sequence of the speculative-decoding verify step (at "
                            "most --steps are used)")
    sized("--layers", "transformer layers, each with its own KV cache")
    sized("--d-model", "model width")
    sized("--num-q-heads", "query heads; a multiple of --num-kv-heads")
    sized("--num-kv-heads", "key/value heads (grouped-query attention)")
    sized("--head-size", "elements per head; a multiple of 64 (swizzled V scales)")
    sized("--mlp", "hidden size of the SwiGLU MLP")
    sized("--vocab", "vocabulary size")
    sized("--block-size", "tokens per cache page; a multiple of 4")
    p.add_argument("--layout", choices=jax_nvfp4.LAYOUTS, default=d.layout,
                   help=f"page layout of the NVFP4 cache (default {d.layout!r})")
    p.add_argument("--scale-search", choices=jax_nvfp4.SCALE_SEARCHES, default=d.scale_search,
                   help=f"block-scale choice of the NVFP4 store: 'default' (amax/6) or '4over6' "
                        f"(also tries amax/4, lower error, slower store) (default "
                        f"{d.scale_search!r})")
    p.add_argument("--extra-blocks", type=int, default=d.extra_blocks, metavar="N",
                   help=f"cache pages beyond what the sequences need (default {d.extra_blocks})")
    p.add_argument("--teacher-force", action="store_true",
                   help="feed the NVFP4 run the bf16 run's tokens (compare every step)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the weights, prompts and page allocation (default {d.seed})")
    p.add_argument("--random-weights", action="store_true",
                   help="random seeded weights (and random prompts) instead of the trained "
                        "model and held-out text; the model size options need this")
    p.add_argument("--no-progress", action="store_true",
                   help="no stage lines or progress bars on stderr")
    p.add_argument("--verbose", action="store_true",
                   help="also print how the run went: device, model, scales, compile and "
                        "donation checks, sample tokens")
    g = p.add_argument_group(
        "long-context mode", "time one decode step over caches already holding --context tokens "
        "per sequence (filled with random values, no prefill), NVFP4 against bf16")
    g.add_argument("--long-context", action="store_true",
                   help="run the long-context benchmark instead of the greedy-decode comparison")
    sized("--context", "tokens already in each sequence's cache", g)
    g.add_argument("--repeats", type=int, default=d.repeats, metavar="N",
                   help=f"timings of --steps steps each; the median is reported (default "
                        f"{d.repeats})")
    g.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                   help=f"untimed steps (calls, with --steps-per-call) after compiling, at "
                        f"least 1 (default {d.warmup})")
    g.add_argument("--nvfp4-jnp", action="store_true",
                   help="also time the NVFP4 cache with paged_attention(impl='jnp') (the XLA "
                        "reader): on a GPU, what the fused kernel buys on the same cache")
    a = p.parse_args(argv)
    # The trained model has one shape; --long-context always uses random weights.
    random_weights = a.random_weights or a.long_context
    model_sizes = [f for f in ("layers", "d_model", "num_q_heads", "num_kv_heads", "head_size",
                               "mlp", "vocab") if getattr(a, f) is not None]
    if model_sizes and not random_weights:
        p.error(f"--{model_sizes[0].replace('_', '-')} sets the size of a random-weight model: "
                f"add --random-weights (the trained model's sizes are fixed)")
    defaults = dict(dataclasses.asdict(d), **(LONG_CONTEXT_DEFAULTS if a.long_context else {}))
    size = {k: getattr(a, k) if getattr(a, k) is not None else defaults[k]
            for k in ("batch", "steps", "prefill_chunk", "draft_tokens", "layers", "d_model",
                      "num_q_heads", "num_kv_heads", "head_size", "mlp", "vocab", "block_size",
                      "context")}
    cfg = Config(prompt_lens=tuple(a.prompt_lens), layout=a.layout,
                 random_weights=random_weights,
                 scale_search=a.scale_search, extra_blocks=a.extra_blocks,
                 teacher_force=a.teacher_force, seed=a.seed, progress=not a.no_progress,
                 steps_per_call=(a.steps_per_call if a.steps_per_call is not None
                                 else d.steps_per_call if a.long_context
                                 else auto_steps_per_call(size["steps"])),
                 verbose=a.verbose,
                 long_context=a.long_context, repeats=a.repeats, warmup=a.warmup,
                 nvfp4_jnp=a.nvfp4_jnp, **size)
    problems = config_problems(cfg)
    if problems:
        p.error("; ".join(problems))
    return cfg


def main(argv=None) -> dict:
    """Parses ``argv`` (default: the command line), runs both decodes (or, with
    ``--long-context``, the long-context timing), prints and returns the results dict (see
    :func:`run` and :func:`run_long_context`)."""
    cfg = parse_args(argv)
    return run_long_context(cfg) if cfg.long_context else run(cfg)


def cli(argv=None) -> int:
    """:func:`main`, then the exit status: 1 when a check failed (chunked prefill or the verify
    step beyond its bound), else 0."""
    return 0 if main(argv).get("checks_passed", True) else 1


if __name__ == "__main__":
    sys.exit(cli())
