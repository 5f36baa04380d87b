"""One ragged attention call of a prefill_bench.py point, jitted and run a few times, with no
timing chains around it: a program for a profiler to attach to (ncu, nsys, compute-sanitizer),
whose first kernel launches are the call's own.

    python benchmarks/one_call.py --point spec32x8 --bound --calls 2
    ncu --set full -k regex:WideRowsKernel --launch-count 1 --kill yes \\
        python3 -P benchmarks/one_call.py --point spec32x8 --bound

Why (benchmarks/NOTES.md, "Where it stands (end of the forty-fourth session)"): under
prefill_bench.py the first WideRowsKernel launch of spec 32 x 8 is the unbound call's (one
split), not the bound one's (`max_q_len`, three splits and the merge) that issue 17's target is
about. The point's pages, tables and queries are prefill_bench.py's (``make_point``,
``make_inputs``), its call ``ragged_attn``; ``--bound`` passes ``max_q_len`` = the point's
longest query, as that benchmark's bound row does. Prints the output's shape and mean |value|
(a check that the call ran).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_bench  # noqa: E402  (this folder: the points, their inputs, the call)


def find_point(name):
    """prefill_bench's point of that name: the full and quick grids', or spec{B}x8."""
    specs = [(n, *rest) for n, *rest in prefill_bench.FULL_POINTS + prefill_bench.QUICK_POINTS]
    for spec in specs:
        if spec[0] == name:
            return prefill_bench.make_point(*spec)
    if name.startswith("spec") and name.endswith("x8") and name[4:-2].isdigit():
        return prefill_bench.make_point(*prefill_bench.spec_points([int(name[4:-2])])[0])
    known = ", ".join(spec[0] for spec in specs)
    raise SystemExit(f"one_call.py: no point {name!r} (known: {known}, or spec<B>x8)")


def run(point, bound, calls, seed=0):
    """The point's call, jitted, run `calls` times: its last output (on the host)."""
    inputs = prefill_bench.make_inputs(point, {"ragged"}, 1, jax.random.PRNGKey(seed))
    lens = {"seq_lens": jnp.asarray(point["seq_lens"], jnp.int32),
            "num_seqs": jnp.int32(len(point["seq_lens"])),
            "cu_q_lens": jnp.asarray(point["cu_q_lens"], jnp.int32)}
    max_q_len = int(np.max(point["q_lens"])) if bound else None
    call = jax.jit(lambda q, table: prefill_bench.ragged_attn(q, table, lens, inputs["nvfp4"],
                                                              max_q_len=max_q_len))
    out = None
    for _ in range(calls):
        out = call(inputs["qs"][0], inputs["tables"][0])
    return np.asarray(out.astype(jnp.float32))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", default="spec32x8",
                        help="a prefill_bench.py point (e.g. spec32x8, chunked8x512, spec2x8)")
    parser.add_argument("--bound", action="store_true",
                        help="pass max_q_len = the point's longest query (the bound row)")
    parser.add_argument("--calls", type=int, default=2, help="calls run (at least 1)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    out = run(find_point(args.point), args.bound, args.calls)
    print(f"{args.point}{' (bound)' if args.bound else ''}: out {out.shape}, "
          f"mean |value| {float(np.abs(out).mean()):.6g}")


if __name__ == "__main__":
    main()
