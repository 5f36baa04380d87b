"""The small decoder-only transformer of the examples and the quality benchmark.

One definition shared by examples/train_tiny_lm.py (training), examples/paged_decode.py (greedy
decoding through a paged KV cache) and benchmarks/quality_bench.py (what a KV cache format costs
in bits per byte): RMSNorm, rotary position embedding (RoPE), grouped-query attention, SwiGLU
MLP, untied embedding and output matrices. The functions take any ``cfg`` with the fields of
:class:`ModelConfig` (the example's own ``Config`` has them too) and compute in the parameters'
dtype (bf16 for the example's random weights, float32 for the trained ones).

``TRAINED_WEIGHTS`` (``examples/tiny_lm.npz``) holds the weights examples/train_tiny_lm.py
trained on the Python standard library's source (byte-level, 256 tokens), stored as float16,
with the configuration and how they were made in the file's ``meta`` entry.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

#: The shipped weights of the trained model.
TRAINED_WEIGHTS = pathlib.Path(__file__).resolve().with_name("tiny_lm.npz")

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model's shape (the trained model's by default: 3.8M parameters)."""
    layers: int = 4
    d_model: int = 256
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    mlp: int = 768
    vocab: int = 256


def model_config(cfg) -> ModelConfig:
    """The model fields of any config object."""
    return ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)})


def num_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def init_params(cfg, seed=None, dtype=jnp.bfloat16):
    """Random weights, std 1/sqrt(fan_in) (embedding std 1); norms start at one.

    ``seed`` defaults to ``cfg.seed``. The same seed gives the same weights in any dtype (drawn
    in float32, then cast).
    """
    seed = cfg.seed if seed is None else seed
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 7 * cfg.layers))

    def dense(fan_in, fan_out):
        w = jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)
        return w.astype(dtype)

    d, qd, kd = cfg.d_model, cfg.num_q_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    layers = []
    for _ in range(cfg.layers):
        layers.append(dict(attn_norm=jnp.ones((d,), dtype), wq=dense(d, qd),
                           wk=dense(d, kd), wv=dense(d, kd), wo=dense(qd, d),
                           mlp_norm=jnp.ones((d,), dtype), w_gate=dense(d, cfg.mlp),
                           w_up=dense(d, cfg.mlp), w_down=dense(cfg.mlp, d)))
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32).astype(dtype)
    return dict(embed=embed, layers=layers, final_norm=jnp.ones((d,), dtype),
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
    """Query, key (both after RoPE: what the cache holds for K) and value heads of x [..., d]."""
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


def forward(cfg, params, tokens, lens=None, kv_transform=None):
    """Dense causal attention over tokens [B, L] (padded: positions >= lens[b] are ignored).

    ``kv_transform(layer_index, k, v) -> (k, v)``, when given, replaces each layer's K and V
    (``[B, L, Hkv, D]``) before attention: e.g. a round trip through a KV-cache format, so
    that every position attends to what a cache would hand back (its own K/V included, as in
    a decode step that stores the token before attending).

    Returns logits ``[B, L, vocab]`` (float32) and, per layer, the K and V the cache would be
    given (K after RoPE; before ``kv_transform``).
    """
    batch, length = tokens.shape
    group = cfg.num_q_heads // cfg.num_kv_heads
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    pos = jnp.arange(length)
    mask = (pos[None, :] <= pos[:, None])[None]
    if lens is not None:
        mask = mask & (pos[None, None, :] < lens[:, None, None])
    x = params["embed"][tokens]
    ks, vs = [], []
    for i, layer in enumerate(params["layers"]):
        q, k, v = qkv(cfg, layer, x, positions)
        ks.append(k)
        vs.append(v)
        if kv_transform is not None:
            k, v = kv_transform(i, k, v)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        qg = q.reshape(batch, length, cfg.num_kv_heads, group, cfg.head_size)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
        s = jnp.where(mask[:, None, None], s / math.sqrt(cfg.head_size), -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
        x = x + o.reshape(batch, length, -1) @ layer["wo"]
        x = x + mlp_block(layer, x)
    return logits_of(params, x), ks, vs


def prefill(cfg, params, tokens, lens):
    """Dense causal attention over padded prompts [B, L].

    Returns the last prompt token's logits [B, vocab] and, per layer, K and V [B, L, Hkv, D]
    (K after RoPE: what the cache holds).
    """
    logits, ks, vs = forward(cfg, params, tokens, lens)
    return logits[jnp.arange(tokens.shape[0]), lens - 1], ks, vs


def bits_per_byte(logits, targets):
    """Mean -log2 p(target) over all positions (logits [..., vocab], targets [...])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.mean(nll) / math.log(2)


# --------------------------------------------------------------------------- weights on disk


def save_weights(path, cfg, params, meta: dict):
    """Writes params as float16 arrays plus a JSON ``meta`` entry (config and provenance)."""
    arrays = {"embed": params["embed"], "final_norm": params["final_norm"],
              "lm_head": params["lm_head"]}
    for i, layer in enumerate(params["layers"]):
        arrays.update({f"layers.{i}.{name}": layer[name] for name in LAYER_WEIGHTS})
    arrays = {k: np.asarray(v, np.float32).astype(np.float16) for k, v in arrays.items()}
    meta = dict(meta, config=dataclasses.asdict(model_config(cfg)))
    np.savez_compressed(path, meta=np.asarray(json.dumps(meta, sort_keys=True)), **arrays)


def load_weights(path=TRAINED_WEIGHTS, dtype=jnp.float32):
    """Reads weights written by :func:`save_weights`: ``(ModelConfig, params, meta)``."""
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["meta"]))
        cfg = ModelConfig(**meta["config"])
        get = lambda name: jnp.asarray(f[name], dtype)        # noqa: E731
        params = dict(embed=get("embed"), final_norm=get("final_norm"), lm_head=get("lm_head"),
                      layers=[{name: get(f"layers.{i}.{name}") for name in LAYER_WEIGHTS}
                              for i in range(cfg.layers)])
    return cfg, params, meta
