"""Greedy decoding of a small transformer with an NVFP4 paged KV cache, against a bf16 one.

A decoder-only model (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP; random seeded weights)
generates tokens for several prompts of different lengths. A host-side block allocator hands out
pages and builds ``block_tables`` and ``slot_mapping``. Prefill runs dense causal attention over
the prompts and writes their K/V into the paged cache of each layer; then a decode loop runs one
step function, compiled once with ``jax.jit``, whose per-layer caches are donated and updated in
place: the new token's K/V are stored, then paged attention reads each sequence's pages.

The same model runs twice: with the NVFP4 cache (``jax_nvfp4.reshape_and_cache`` +
``paged_attention``) and with a bf16 paged cache (``.at[slots].set`` + ``paged_attention_bf16``).
It prints decode throughput, cache sizes, the greedy-token agreement of the two runs and how
far their logits are apart. Runs on JAX's default device (the GPU when there is one).

    python examples/paged_decode.py
    python examples/paged_decode.py --batch 8 --prompt-lens 5 60 130 --steps 64 --layout NHD
"""

import argparse
import dataclasses
import math
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from jax_nvfp4.attention import paged_attention, paged_attention_bf16

KINDS = ("bf16", "nvfp4")


@dataclasses.dataclass
class Config:
    batch: int = 4
    prompt_lens: tuple = (7, 16, 29, 50)   # cycled when batch is larger
    steps: int = 32
    layers: int = 2
    d_model: int = 256
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    mlp: int = 512
    vocab: int = 1024
    block_size: int = 16
    layout: str = "HND"
    scale_search: str = "default"
    extra_blocks: int = 8                  # pages beyond what the sequences need
    teacher_force: bool = False            # NVFP4 run fed the bf16 run's tokens
    seed: int = 0
    progress: bool = True
    verbose: bool = True


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


def init_params(cfg: Config):
    """Random weights (bf16), std 1/sqrt(fan_in); norms start at one."""
    keys = iter(jax.random.split(jax.random.PRNGKey(cfg.seed), 4 + 7 * cfg.layers))

    def dense(fan_in, fan_out):
        w = jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)
        return w.astype(jnp.bfloat16)

    d, qd, kd = cfg.d_model, cfg.num_q_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    layers = []
    for _ in range(cfg.layers):
        layers.append(dict(attn_norm=jnp.ones((d,), jnp.bfloat16), wq=dense(d, qd),
                           wk=dense(d, kd), wv=dense(d, kd), wo=dense(qd, d),
                           mlp_norm=jnp.ones((d,), jnp.bfloat16), w_gate=dense(d, cfg.mlp),
                           w_up=dense(d, cfg.mlp), w_down=dense(cfg.mlp, d)))
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32).astype(jnp.bfloat16)
    return dict(embed=embed, layers=layers, final_norm=jnp.ones((d,), jnp.bfloat16),
                lm_head=dense(d, cfg.vocab))


def rms_norm(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta=10000.0):
    """Rotary embedding, rotate-half form. x [..., heads, D]; positions broadcast to x[..., 0, 0]."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None, None] * freq        # [..., 1, half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def qkv(cfg, layer, x, positions):
    h = rms_norm(x, layer["attn_norm"])
    lead = x.shape[:-1]
    q = (h @ layer["wq"]).reshape(*lead, cfg.num_q_heads, cfg.head_size)
    k = (h @ layer["wk"]).reshape(*lead, cfg.num_kv_heads, cfg.head_size)
    v = (h @ layer["wv"]).reshape(*lead, cfg.num_kv_heads, cfg.head_size)
    return rope(q, positions), rope(k, positions), v


def mlp_block(layer, x):
    h = rms_norm(x, layer["mlp_norm"])
    return (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]


def logits_of(params, x):
    return (rms_norm(x, params["final_norm"]) @ params["lm_head"]).astype(jnp.float32)


def prefill(cfg, params, tokens, lens):
    """Dense causal attention over padded prompts [B, L].

    Returns the last prompt token's logits [B, vocab] and, per layer, K and V [B, L, Hkv, D]
    (K after RoPE: what the cache holds).
    """
    batch, length = tokens.shape
    group = cfg.num_q_heads // cfg.num_kv_heads
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    pos = jnp.arange(length)
    mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])
    x = params["embed"][tokens]
    ks, vs = [], []
    for layer in params["layers"]:
        q, k, v = qkv(cfg, layer, x, positions)
        ks.append(k)
        vs.append(v)
        qg = q.reshape(batch, length, cfg.num_kv_heads, group, cfg.head_size)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
        s = jnp.where(mask[:, None, None], s / math.sqrt(cfg.head_size), -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
        x = x + o.reshape(batch, length, -1) @ layer["wo"]
        x = x + mlp_block(layer, x)
    last = x[jnp.arange(batch), lens - 1]
    return logits_of(params, last), ks, vs


def calibrate(ks, vs, lens):
    """Per-layer k_scale, v_scale = amax over the prompts' valid tokens / 448 (spec §1)."""
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


def make_decode_step(cfg, kind, trace_counter):
    """The decode step, compiled once: (params, caches, scales, tokens, slot_mapping,
    block_tables, seq_lens) -> (next tokens, logits, caches). Caches (argument 1) are donated.

    ``trace_counter[kind]`` counts how often JAX traces it (once, if nothing recompiles).
    """

    def step(params, caches, scales, tokens, slot_mapping, block_tables, seq_lens):
        trace_counter[kind] += 1
        positions = seq_lens - 1                        # the new token's position
        x = params["embed"][tokens]                     # [B, d]
        new_caches = []
        for layer, cache, scale in zip(params["layers"], caches, scales):
            q, k, v = qkv(cfg, layer, x, positions)     # [B, heads, D]
            cache = store(cfg, kind, k, v, cache, slot_mapping, scale)
            if kind == "nvfp4":
                attn = paged_attention(q, cache, block_tables, seq_lens, *scale,
                                       layout=cfg.layout)
            else:
                attn = paged_attention_bf16(q, *cache, block_tables, seq_lens)
            new_caches.append(cache)
            x = x + attn.reshape(x.shape[0], -1) @ layer["wo"]
            x = x + mlp_block(layer, x)
        logits = logits_of(params, x)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, tuple(new_caches)

    return jax.jit(step, donate_argnums=1)


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


def cache_bytes(caches) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(caches))


# --------------------------------------------------------------------------- driver


class Progress:
    """tqdm when importable, else a plain text bar on stderr."""

    def __init__(self, total, desc, enabled=True):
        self.total, self.desc, self.n, self.enabled = total, desc, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=False)
            except ImportError:
                pass

    def update(self):
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            return
        width = 30
        done = width * self.n // self.total
        sys.stderr.write(f"\r{self.desc}: [{'#' * done}{'.' * (width - done)}] "
                         f"{self.n}/{self.total}")
        sys.stderr.flush()

    def close(self):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\r" + " " * (len(self.desc) + 50) + "\r")
            sys.stderr.flush()


def _prompt_lens(cfg):
    lens = list(cfg.prompt_lens)
    if not lens or min(lens) < 1:
        raise ValueError(f"prompt lengths must be >= 1, got {lens}")
    return [lens[i % len(lens)] for i in range(cfg.batch)]


def decode(cfg, kind, params, prefill_out, prompt_lens, num_blocks, max_blocks, trace_counter,
           forced_tokens=None):
    """One run: allocate, store the prompts, decode ``cfg.steps`` tokens. Returns a dict."""
    first_logits, ks, vs, scales = prefill_out
    seqs = list(range(cfg.batch))
    alloc = BlockAllocator(num_blocks, cfg.block_size, max_blocks, seed=cfg.seed + 1)
    for s in seqs:
        alloc.add_sequence(s)
    length = ks[0].shape[1]
    slot_mapping = np.full((cfg.batch, length), -1, np.int32)
    for s, n in zip(seqs, prompt_lens):
        slot_mapping[s, :n] = alloc.append_slots(s, n)

    caches = allocate_caches(cfg, kind, num_blocks)
    caches = make_prefill_store(cfg, kind)(caches, ks, vs, jnp.asarray(slot_mapping.reshape(-1)),
                                           scales)
    step = make_decode_step(cfg, kind, trace_counter)
    step_scales = scales if kind == "nvfp4" else tuple(() for _ in scales)

    tokens = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)   # first generated token
    generated, all_logits = [tokens], []
    donated = None
    progress = Progress(cfg.steps, f"decode {kind}", cfg.progress)
    jax.block_until_ready(caches)
    t0 = time.perf_counter()
    t_first = None
    for i in range(cfg.steps):
        if forced_tokens is not None:
            tokens = jnp.asarray(forced_tokens[:, i])
        slots = np.concatenate([alloc.append_slots(s, 1) for s in seqs])
        old = caches
        tokens, logits, caches = step(params, caches, step_scales, tokens, slots,
                                      alloc.block_tables(seqs), alloc.seq_lens(seqs))
        if i == 0:
            jax.block_until_ready(tokens)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            donated = all(x.is_deleted() for x in jax.tree.leaves(old))
        del old
        generated.append(tokens)
        all_logits.append(logits)
        progress.update()
    jax.block_until_ready((generated, caches))
    t_rest = time.perf_counter() - t0
    progress.close()

    # How the step compiled: donated caches show up as input/output aliases in the HLO.
    args = (params, caches, step_scales, tokens, slots, alloc.block_tables(seqs),
            alloc.seq_lens(seqs))
    traces = trace_counter[kind]
    hlo = step.lower(*args).compile().as_text()
    header = hlo.split("\n", 1)[0]
    num_aliased = header.count("may-alias") + header.count("must-alias")
    cache_copies = sum(len(re.findall(rf"= {re.escape(shape)}\{{[^}}]*\}} copy\(", hlo))
                       for shape in {_hlo_shape(x) for x in jax.tree.leaves(caches)})
    return dict(
        tokens=np.stack([np.asarray(t) for t in generated], axis=1),     # [B, steps + 1]
        logits=np.stack([np.asarray(x) for x in all_logits], axis=1),    # [B, steps, vocab]
        first_step_s=t_first,
        tokens_per_s=cfg.batch * (cfg.steps - 1) / t_rest if cfg.steps > 1 else float("nan"),
        cache_bytes=cache_bytes(caches),
        traces=traces,
        jit_cache_size=step._cache_size(),
        caches_donated=donated,
        hlo_aliased_outputs=num_aliased,
        hlo_cache_copies=cache_copies,
        cache_leaves=len(jax.tree.leaves(caches)),
        seq_lens=alloc.seq_lens(seqs),
    )


def run(cfg: Config) -> dict:
    """Prefill once, decode with both caches, compare. Returns a results dict."""
    t_start = time.perf_counter()
    jax_nvfp4.layout.check_layout(cfg.layout)
    jax_nvfp4.layout.check_scale_search(cfg.scale_search)
    prompt_lens = _prompt_lens(cfg)
    rng = np.random.default_rng(cfg.seed)
    length = max(prompt_lens)
    prompts = np.zeros((cfg.batch, length), np.int32)
    for b, n in enumerate(prompt_lens):
        prompts[b, :n] = rng.integers(0, cfg.vocab, n)
    params = init_params(cfg)

    lens = jnp.asarray(prompt_lens, jnp.int32)
    first_logits, ks, vs = jax.jit(lambda p, t, n: prefill(cfg, p, t, n))(
        params, jnp.asarray(prompts), lens)
    scales = calibrate(ks, vs, lens)
    prefill_out = (first_logits, ks, vs, scales)

    total = [n + cfg.steps for n in prompt_lens]
    max_blocks = max(math.ceil(n / cfg.block_size) for n in total)
    num_blocks = sum(math.ceil(n / cfg.block_size) for n in total) + cfg.extra_blocks
    trace_counter = {k: 0 for k in KINDS}
    runs = {}
    runs["bf16"] = decode(cfg, "bf16", params, prefill_out, prompt_lens, num_blocks, max_blocks,
                          trace_counter)
    forced = runs["bf16"]["tokens"][:, :-1] if cfg.teacher_force else None
    runs["nvfp4"] = decode(cfg, "nvfp4", params, prefill_out, prompt_lens, num_blocks,
                           max_blocks, trace_counter, forced_tokens=forced)

    # Compare. Decode step i consumed token i and produced token i + 1.
    a, b = runs["nvfp4"], runs["bf16"]
    produced_a, produced_b = a["tokens"][:, 1:], b["tokens"][:, 1:]
    if cfg.teacher_force:   # same inputs at every step: compare each step's greedy choice
        same = produced_a == produced_b
        comparable = np.ones_like(same)
        first_divergence = np.where(same.all(1), cfg.steps, np.argmin(same, axis=1))
    else:                   # free-running: the histories match up to the first difference
        same = produced_a == produced_b
        first_divergence = np.where(same.all(1), cfg.steps, np.argmin(same, axis=1))
        comparable = np.arange(cfg.steps)[None, :] <= first_divergence[:, None]
    diff = np.abs(a["logits"] - b["logits"])[comparable]
    top2 = np.sort(b["logits"][comparable], axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]          # how close the bf16 run's greedy choices were
    results = dict(
        config=dataclasses.asdict(cfg),
        device=str(jax.devices()[0]),
        prompt_lens=prompt_lens,
        prompts=prompts,
        tokens_nvfp4=a["tokens"], tokens_bf16=b["tokens"],     # [B, steps + 1]
        logits_nvfp4=a["logits"], logits_bf16=b["logits"],     # [B, steps, vocab]
        agreement=float(same.mean()),
        # Greedy choices made from identical inputs that agree (equals agreement when
        # teacher-forced; free-running: every step up to and including the first divergence).
        step_agreement=float(same[comparable].mean()),
        first_divergence=first_divergence.tolist(),
        logits_max_abs_diff=float(diff.max()),
        logits_mean_abs_diff=float(diff.mean()),
        logits_mean_abs=float(np.abs(b["logits"]).mean()),
        logits_compared_steps=int(comparable.sum()),
        bf16_top2_margin_median=float(np.median(margin)),
        tokens_per_s={k: r["tokens_per_s"] for k, r in runs.items()},
        first_step_s={k: r["first_step_s"] for k, r in runs.items()},
        cache_bytes={k: r["cache_bytes"] for k, r in runs.items()},
        cache_ratio=b["cache_bytes"] / a["cache_bytes"],
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
    if cfg.verbose:
        report(cfg, results)
    return results


def report(cfg, r):
    print(f"device: {r['device']}")
    print(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.num_q_heads} q heads / "
          f"{cfg.num_kv_heads} kv heads x {cfg.head_size}, mlp {cfg.mlp}, vocab {cfg.vocab}")
    print(f"batch {cfg.batch}, prompt lengths {r['prompt_lens']}, {cfg.steps} decode steps, "
          f"block_size {cfg.block_size}, {r['num_blocks']} pages, layout {cfg.layout}, "
          f"scale_search {cfg.scale_search}")
    print("k_scale per layer: " + ", ".join(f"{s:.4g}" for s in r["k_scales"])
          + "; v_scale: " + ", ".join(f"{s:.4g}" for s in r["v_scales"]))
    for k in KINDS:
        print(f"{k:>5}: {r['tokens_per_s'][k]:9.1f} tokens/s (first step incl. compile "
              f"{r['first_step_s'][k]:.2f} s), cache {r['cache_bytes'][k]:,} bytes, "
              f"step traced {r['traces'][k]}x, jit cache entries {r['jit_cache_size'][k]}, "
              f"caches donated {r['caches_donated'][k]}, "
              f"aliased outputs {r['hlo_aliased_outputs'][k]}/{r['cache_leaves'][k]}, "
              f"cache copies in HLO {r['hlo_cache_copies'][k]}")
    print(f"cache: NVFP4 is {r['cache_ratio']:.2f}x smaller than bf16")
    mode = "teacher-forced (NVFP4 fed the bf16 tokens)" if cfg.teacher_force else "free-running"
    print(f"greedy-token agreement ({mode}): {100 * r['agreement']:.1f}%; first divergence "
          f"step per sequence: {r['first_divergence']} (of {cfg.steps})")
    print(f"per-step greedy agreement from identical inputs: {100 * r['step_agreement']:.1f}% "
          f"of {r['logits_compared_steps']} sequence-steps")
    print(f"logits |NVFP4 - bf16| over {r['logits_compared_steps']} sequence-steps with equal "
          f"inputs: max {r['logits_max_abs_diff']:.4f}, mean {r['logits_mean_abs_diff']:.4f} "
          f"(mean |logit| {r['logits_mean_abs']:.3f}; median bf16 top-1 - top-2 margin "
          f"{r['bf16_top2_margin_median']:.3f})")
    for b in range(min(cfg.batch, 4)):
        print(f"  seq {b} bf16 : {r['tokens_bf16'][b, :12].tolist()}")
        print(f"  seq {b} nvfp4: {r['tokens_nvfp4'][b, :12].tolist()}")
    print(f"wall time {r['wall_s']:.1f} s")


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=list(d.prompt_lens),
                   help="prompt lengths, cycled over the batch")
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--num-q-heads", type=int, default=d.num_q_heads)
    p.add_argument("--num-kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--head-size", type=int, default=d.head_size)
    p.add_argument("--mlp", type=int, default=d.mlp)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--layout", choices=jax_nvfp4.LAYOUTS, default=d.layout)
    p.add_argument("--scale-search", choices=jax_nvfp4.SCALE_SEARCHES, default=d.scale_search)
    p.add_argument("--extra-blocks", type=int, default=d.extra_blocks)
    p.add_argument("--teacher-force", action="store_true",
                   help="feed the NVFP4 run the bf16 run's tokens (compare every step)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return Config(batch=a.batch, prompt_lens=tuple(a.prompt_lens), steps=a.steps,
                  layers=a.layers, d_model=a.d_model, num_q_heads=a.num_q_heads,
                  num_kv_heads=a.num_kv_heads, head_size=a.head_size, mlp=a.mlp, vocab=a.vocab,
                  block_size=a.block_size, layout=a.layout, scale_search=a.scale_search,
                  extra_blocks=a.extra_blocks, teacher_force=a.teacher_force, seed=a.seed,
                  progress=not a.no_progress)


def main(argv=None) -> dict:
    """Parses ``argv`` (default: the command line), runs both decodes, prints and returns the
    results dict (see :func:`run`)."""
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
