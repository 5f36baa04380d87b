"""Per-CTA timeline of one decode launch (developers' tool; needs the decode_trace variant's
build, benchmarks/variants/decode_trace.patch, which adds _ffi._decode_trace_take).

For each CTA of the decode kernel it prints the SM, and, in ns from the launch's first CTA
start (the global timer, comparable across SMs): the start, when each warp finished its
chunks, the warps' merge, the first cluster barrier passed (cluster merge only) and the end.
Then per cluster (the splits of one (sequence, kv head, head tile)): the spread of its CTAs'
starts and merges and how long each CTA waited at the first barrier for the slowest. It answers
whether a cluster's CTAs start late (launch, placement) or run long (their chains differ).

    PYTHONPATH=/tmp/ab/B python3 -P benchmarks/decode_trace.py --points 1x4096,8x4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import attention_bench as ab  # noqa: E402  (this folder: the decode grid's inputs)

# The variant's layout (ffi/decode_cuda.cu with decode_trace.patch): per CTA kTraceWords
# uint64: kTraceEvents global-timer ns, kTraceEvents clock64, the SM, blockIdx (y << 32 | x).
TRACE_CTAS, EVENTS = 8192, 8
WORDS = 2 * EVENTS + 2
WARPS = 4
ENTRY, CHUNKS, MERGED, SYNCED, END = 0, 1, 1 + WARPS, 2 + WARPS, 3 + WARPS


def take():
    return ab.trace_take("decode_trace", TRACE_CTAS, WORDS)


def point_of(name):
    batch, context = (int(x) for x in name.split("x"))
    lens = np.full(batch, context, np.int64)
    return {"name": name, "batch": batch, "lens": lens, "context": context,
            "pages": -(-lens // ab.BLOCK_SIZE)}


def one_launch(call, args):
    take()                                     # clear what earlier launches left
    jax.block_until_ready(call(*args))
    t = take()
    used = t[:, ENTRY] != 0
    return t[used]


def describe(t, verbose):
    start0 = t[:, ENTRY].min()
    ns = t[:, :EVENTS] - start0
    ns[t[:, :EVENTS] == 0] = -1                # events a CTA never reached (an early return)
    block = t[:, 2 * EVENTS + 1]
    bx, by = block & 0xFFFFFFFF, block >> 32
    span = t[:, END].max() - start0
    clusters = {}
    for i in range(len(t)):
        clusters.setdefault(int(bx[i]), []).append(i)
    print(f"  {len(t)} CTAs on {len(set(t[:, 2 * EVENTS].tolist()))} SMs, {len(clusters)} units "
          f"(blockIdx.x) x up to {int(by.max()) + 1} splits; first start to last end "
          f"{span / 1e3:.2f} us; starts spread {np.ptp(ns[:, ENTRY]) / 1e3:.2f} us")
    deltas = np.diff(np.unique(t[:, :EVENTS][t[:, :EVENTS] > 0]))
    print(f"  smallest nonzero step of the global timer seen: {deltas[deltas > 0].min()} ns")
    ended = t[:, END] != 0                     # (not the CTAs that returned early)
    print(f"  {int((~ended).sum())} CTAs returned early (no end event)")
    if ended.any():
        cyc = (t[:, EVENTS + END] - t[:, EVENTS + ENTRY])[ended]
        print(f"  CTA lifetimes (clock64): median {np.median(cyc):.0f}, min {cyc.min()}, "
              f"max {cyc.max()} cycles")
    waits, spreads_start, spreads_merge = [], [], []
    for unit, rows in sorted(clusters.items()):
        rows = sorted(rows, key=lambda i: by[i])
        starts, merged, synced = ns[rows, ENTRY], ns[rows, MERGED], ns[rows, SYNCED]
        spreads_start.append(np.ptp(starts))
        if (merged >= 0).all():
            spreads_merge.append(np.ptp(merged))
        if (synced >= 0).all():
            waits.extend((synced - merged).tolist())
        if verbose:
            for i in rows:
                chunks = " ".join(f"{ns[i, CHUNKS + w] / 1e3:6.2f}" for w in range(WARPS))
                print(f"    unit {unit:4d} split {int(by[i]):2d} sm {int(t[i, 2 * EVENTS]):3d}: "
                      f"start {ns[i, ENTRY] / 1e3:6.2f} chunks {chunks} merged "
                      f"{ns[i, MERGED] / 1e3:6.2f} synced {ns[i, SYNCED] / 1e3:6.2f} end "
                      f"{ns[i, END] / 1e3:6.2f} us")
    print(f"  per unit: starts spread median {statistics.median(spreads_start) / 1e3:.2f} us "
          f"(max {max(spreads_start) / 1e3:.2f})")
    if spreads_merge:
        print(f"  per unit whose CTAs all merged: merges spread median "
              f"{statistics.median(spreads_merge) / 1e3:.2f} us "
              f"(max {max(spreads_merge) / 1e3:.2f})")
    if waits:
        print(f"  wait at the first cluster barrier (synced - merged): median "
              f"{statistics.median(waits) / 1e3:.2f} us, max {max(waits) / 1e3:.2f} us")
    chunked = (ns[:, CHUNKS:CHUNKS + WARPS] >= 0).all(axis=1)
    if chunked.any():
        done = (ns[:, CHUNKS:CHUNKS + WARPS].max(axis=1) - ns[:, ENTRY])[chunked]
        print(f"  start to the last warp's chunks done ({int(chunked.sum())} CTAs with chunks): "
              f"median {np.median(done) / 1e3:.2f} us, min {done.min() / 1e3:.2f}, max "
              f"{done.max() / 1e3:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="1x4096", help="batch x context, comma-separated")
    parser.add_argument("--launches", type=int, default=3, help="launches traced per point")
    parser.add_argument("--verbose", action="store_true", help="one line per CTA")
    args = parser.parse_args(argv)
    refusal = ab.trace_refusal("decode_trace", "decode kernel")
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    for name in args.points.split(","):
        point = point_of(name)
        inputs = ab.make_inputs(point, ["kernel"], 1, jax.random.key(0))
        attn = jax.jit(ab.nvfp4_attn("auto"))
        call_args = (inputs["qs"][0], inputs["tables"][0], inputs["lens"], inputs["arrays"])
        for _ in range(20):                    # compile, warm
            jax.block_until_ready(attn(*call_args))
        for launch in range(args.launches):
            print(f"{name}, launch {launch + 1}:")
            describe(one_launch(attn, call_args), args.verbose and launch == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
