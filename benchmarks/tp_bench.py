"""The tensor-parallel decode step of the README ("Many layers") on G devices, timed against one
device holding all G head groups (issue 24).

    python benchmarks/tp_bench.py             # two GPUs: 2 head groups, Llama-3-8B's attention
    python benchmarks/tp_bench.py --quick     # tiny shapes, a smoke run (2 CPU devices)

The step is the README's recipe: every layer's pages in one grouped pool ``[G, L * num_blocks, 2,
num_kv_heads / G, block_size, F]`` sharded ``P("tp")``, and a ``lax.scan`` over the L layers,
each storing one new token per sequence into its group's pages
(``jax_nvfp4.sharding.reshape_and_cache_grouped`` at ``layer_slots``) and attending over them
(``paged_attention_grouped`` with ``layer_block_tables``), the pool donated. The same jitted step
runs on a mesh of G devices, one group each, and on a mesh of one device holding every group;
the compiled G-device step must communicate nothing (no collective in its HLO), and after the
runs the two pools must hold the same bytes, which are not the bytes they started from (the
store is exact; both started from the same random bytes and stored the same tokens), and the
attention outputs agree within rounding (one device holds G times the work, so its split plan
may differ).

Timing: the benchmarks' chained method (store_bench.chained_time): n steps in one compiled
program, step i's queries depending on step i-1's output, (t(n2) - t(n1)) / (n2 - n1) from the
median of ``--repeats`` runs of each chain. Reported per step: µs on G devices, µs on one
device, and their ratio (G where the groups' work splits perfectly; each device reads 1/G of the
pages).

Default shapes: 32 query and 8 kv heads of 128 (Llama-3-8B's attention), 4 layers, 32 sequences
at 8192 positions, pages of 16, bf16, 2 groups: 1.2 GB of pages. ``--quick``: 2 layers, 2
sequences of 48 positions, 8 query and 4 kv heads of 64. Writes ``tp_bench.json``, ``.md`` and
``.png`` (the plot needs matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_nvfp4  # noqa: E402
from jax_nvfp4 import layout as nv_layout  # noqa: E402
from jax_nvfp4 import sharding as shd  # noqa: E402

import attention_bench as ab  # noqa: E402  (this folder: the pages' scale bytes)
import store_bench  # noqa: E402  (this folder: the chained timer, the output files)

FULL = dict(layers=4, batch=32, context=8192, num_q_heads=32, num_kv_heads=8, head_size=128)
QUICK = dict(layers=2, batch=2, context=48, num_q_heads=8, num_kv_heads=4, head_size=64)
BLOCK_SIZE = 16
K_SCALE = V_SCALE = 3.0 / 448
#: HLO opcodes that communicate (tests/hlo_checks.py's list, which tests cannot share with a
#: benchmark: benchmarks do not import tests).
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter",
               "collective-broadcast", "ragged-all-to-all")
#: Attention outputs of the two meshes may differ by their split plans' rounding, no more: in
#: bf16 one flipped last bit is up to 2^-7 of a value, so 2^-7 of the largest output; a wrong
#: head group or page would differ by the order of the outputs themselves.
MAX_OUTPUT_DIFFERENCE = 2e-2


def shapes(args):
    s = dict(QUICK if args.quick else FULL)
    for name in s:
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    s["groups"] = args.devices
    s["blocks_per_seq"] = -(-s["context"] // BLOCK_SIZE)
    s["num_blocks"] = s["batch"] * s["blocks_per_seq"]  # one layer's pages
    return s


def make_inputs(s, seed):
    """Host arrays: the pool (random codes, scale bytes in attention_bench's range), each
    layer's block tables (a random permutation of its pages), the new token's slot per
    sequence (its last position), and q / key / value of every layer."""
    rng = np.random.default_rng(seed)
    shape = shd.grouped_kv_cache_shape(s["groups"], s["layers"] * s["num_blocks"], BLOCK_SIZE,
                                       s["num_kv_heads"], s["head_size"])
    geo = nv_layout.CacheGeometry.from_shape(shape[1:], "HND")
    sides = shape[:3]                                   # [G, blocks, 2]
    data = rng.integers(0, 256, sides + (geo.side_data_bytes,), np.uint8)
    scales = rng.integers(ab.SCALE_BYTE_RANGE[0], ab.SCALE_BYTE_RANGE[1] + 1,
                          sides + (geo.side_bytes - geo.side_data_bytes,), np.uint8)
    pool = np.concatenate([data, scales], axis=-1).reshape(shape)
    tables = rng.permutation(s["num_blocks"]).astype(np.int32).reshape(s["batch"], -1)
    last = s["context"] - 1
    slots = tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    lens = np.full(s["batch"], s["context"], np.int32)

    def heads(n):
        x = rng.standard_normal((s["layers"], s["batch"], n, s["head_size"]), np.float32)
        return jnp.asarray(x, jnp.bfloat16)

    return pool, (heads(s["num_q_heads"]), heads(s["num_kv_heads"]), heads(s["num_kv_heads"]),
                  slots.astype(np.int32), tables, lens)


def make_step(s):
    """step((prev_out, pool), q, key, value, slots, tables, lens) -> (out, pool): one decode step
    of every layer; q depends on the previous step's output (a chain's order)."""
    num_blocks, layers = s["num_blocks"], s["layers"]

    def step(state, q, key, value, slots, tables, lens):
        prev, pool = state
        q = q + prev * 0

        def layer(pool, x):
            l, q_l, key_l, value_l = x
            pool = shd.reshape_and_cache_grouped(
                key_l, value_l, pool, shd.layer_slots(slots, l, num_blocks, BLOCK_SIZE),
                K_SCALE, V_SCALE)
            out = shd.paged_attention_grouped(
                q_l, pool, shd.layer_block_tables(tables, l, num_blocks), lens, K_SCALE, V_SCALE)
            return pool, out

        pool, out = jax.lax.scan(layer, pool, (jnp.arange(layers), q, key, value))
        return out, pool

    return step


def place(mesh, pool, inputs):
    """The state (a zero previous output, the pool) and the step's inputs on ``mesh``: the pool
    along its group axis, q / key / value along their head axis, the rest replicated."""
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    heads = P(None, None, "tp")
    q, key, value, slots, tables, lens = inputs
    state = (put(jnp.zeros(q.shape, q.dtype), heads), put(pool, P("tp")))
    return state, (put(q, heads), put(key, heads), put(value, heads), put(slots, P()),
                   put(tables, P()), put(lens, P()))


def collectives(step, state, args):
    """The collective ops in the compiled HLO of one step (none expected)."""
    hlo = jax.jit(step, donate_argnums=0).lower(state, *args).compile().as_text() or ""
    return sorted({c for c in COLLECTIVES if c in hlo})


def run_mesh(devices, s, pool, inputs, args):
    mesh = Mesh(np.array(devices), ("tp",))
    step = make_step(s)
    state, step_args = place(mesh, pool, inputs)
    found = collectives(step, state, step_args)
    n2 = args.chain
    seconds, state = store_bench.chained_time(step, state, [step_args] * n2, 2, n2, args.repeats)
    out, pool_after = state
    return {"devices": len(devices), "us_per_step": seconds * 1e6, "collectives": found,
            "out": np.asarray(out.astype(jnp.float32)), "pool": np.asarray(pool_after)}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4.5, 3))
    labels = [f"{r['devices']} device{'s' * (r['devices'] > 1)}" for r in result["rows"]]
    ax.bar(labels, [r["us_per_step"] for r in result["rows"]])
    ax.set_ylabel("µs per decode step")
    ax.set_title(f"{result['shapes']['layers']} layers, {result['shapes']['batch']} x "
                 f"{result['shapes']['context']}, {result['shapes']['groups']} head groups")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, e.g. on CPU)")
    p.add_argument("--devices", type=int, default=2, help="head groups = devices of the mesh")
    for name in FULL:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--repeats", type=int, default=5, help="runs per median")
    p.add_argument("--chain", type=int, default=None,
                   help="steps in the longer chain (the shorter has 2; default 16, quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON, table and PNG")
    args = p.parse_args(argv)
    args.chain = args.chain or (4 if args.quick else 16)
    if args.chain < 3:
        p.error("--chain must be at least 3")
    if args.devices < 1:
        p.error("--devices must be at least 1")
    # Enough CPU devices for the mesh where there is no GPU, if JAX has not started a backend
    # yet (a caller that has started one keeps its devices).
    try:
        jax.config.update("jax_num_cpu_devices", max(args.devices, 1))
    except RuntimeError:
        pass
    s = shapes(args)
    if s["num_kv_heads"] % s["groups"]:
        p.error(f"--devices {s['groups']} must divide num_kv_heads {s['num_kv_heads']}")
    gpu = store_bench.on_gpu()
    if not gpu:
        print(store_bench.smoke_run_note(), flush=True)
    devices = jax.devices()
    if len(devices) < s["groups"]:
        raise SystemExit(f"needs {s['groups']} devices of one kind, {len(devices)} "
                         f"{devices[0].platform} device(s) visible")
    print(f"{s['groups']} x {devices[0].device_kind}; {s['layers']} layers, {s['batch']} "
          f"sequences x {s['context']} positions, {s['num_q_heads']} q / {s['num_kv_heads']} kv "
          f"heads of {s['head_size']}", flush=True)
    pool, inputs = make_inputs(s, args.seed)
    rows = [run_mesh(devices[:s["groups"]], s, pool, inputs, args),
            run_mesh(devices[:1], s, pool, inputs, args)]
    many, one = rows
    if many["collectives"]:
        raise SystemExit(f"the {many['devices']}-device step communicates: {many['collectives']}")
    if not np.array_equal(many["pool"], one["pool"]):
        raise SystemExit("the two meshes' pools differ after the same steps")
    if np.array_equal(one["pool"], pool):
        raise SystemExit("the steps stored nothing: the pool holds the bytes it started with")
    scale = float(np.max(np.abs(one["out"]))) or 1.0
    difference = float(np.max(np.abs(many["out"] - one["out"]))) / scale
    if not difference <= MAX_OUTPUT_DIFFERENCE:
        raise SystemExit(f"the two meshes' outputs differ by {difference:.3g} of their largest")
    ratio = one["us_per_step"] / many["us_per_step"]
    lines = ["| devices | µs / step | vs one device |", "| ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['devices']} | {r['us_per_step']:.1f} | "
                     f"{one['us_per_step'] / r['us_per_step']:.2f}x |")
    text = "\n".join(
        [f"Tensor-parallel decode step ({jax_nvfp4.__name__}, {devices[0].device_kind}): "
         f"{s['layers']} layers, {s['batch']} x {s['context']}, {s['groups']} head groups"]
        + lines
        + [f"no collective in the {many['devices']}-device step; pools equal after the runs "
           f"(and stored into); "
           f"outputs within {difference:.2g} of their largest"])
    result = {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
              "shapes": s, "rows": [{k: v for k, v in r.items() if k not in ("out", "pool")}
                                    for r in rows],
              "ratio": ratio, "output_difference": difference}
    os.makedirs(args.out, exist_ok=True)
    store_bench.write_outputs(args.out, "tp_bench", result, text, plot)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
