"""One attention call of a benchmark point, jitted and run a few times, with no timing chains
around it: a program for a profiler to attach to (ncu, nsys, compute-sanitizer), whose kernel
launches are the call's own.

    python benchmarks/one_call.py --point spec32x8 --bound --calls 2
    ncu --set full -k regex:WideRowsKernel --launch-count 1 --kill yes \\
        python3 -P benchmarks/one_call.py --point spec32x8 --bound
    ncu --set full -k regex:DecodeKernel --launch-count 1 --kill yes \\
        python3 -P benchmarks/one_call.py --point 1x4096
    ncu --set full -k regex:WideRowsKernel --launch-count 1 -o wide \\
        python3 -P benchmarks/one_call.py --point spec32x8 --bound
    ncu --import wide.ncu-rep --page source --csv --print-source sass > wide-sass.csv

(The last form is the one that served the source view: on the H100 of 2026-12-07 the live
``--page source --print-source sass`` run, and once a ``-o`` run, died of a segmentation
fault right after ncu attached, before any kernel; the same ``-o`` run again worked.)

A prefill_bench.py point (chunked1x2048, spec32x8, spec<B>x8, ...) is its ragged call
(``ragged_attn`` on that benchmark's pages, tables and queries; ``--bound`` passes
``max_q_len`` = the point's longest query, as its bound row does); an attention_bench.py point
(``BxC``: B sequences of C tokens, ``raggedN``) is the decode reader's call (``paged_attention``
on that benchmark's pages). Why (benchmarks/NOTES.md, "Where it stands (end of the forty-fourth
session)"): under prefill_bench.py the first WideRowsKernel launch of spec 32 x 8 is the unbound
call's (one split), not the bound one's (three splits and the merge) that issue 17's target is
about; and a chain's glue kernels come between the calls of either benchmark. Prints the
output's shape and mean |value| (a check that the call ran).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_bench  # noqa: E402  (this folder: the decode points, their inputs, the call)
import prefill_bench  # noqa: E402  (the ragged points, their inputs, the call)


def find_point(name):
    """prefill_bench's point of that name (its full and quick grids', or spec{B}x8), or None."""
    specs = prefill_bench.FULL_POINTS + prefill_bench.QUICK_POINTS
    for spec in specs:
        if spec[0] == name:
            return prefill_bench.make_point(*spec)
    if name.startswith("spec") and name.endswith("x8") and name[4:-2].isdigit():
        return prefill_bench.make_point(*prefill_bench.spec_points([int(name[4:-2])])[0])
    return None


def ragged_call(point, bound, seed=0):
    """A prefill_bench point's ragged call (its ragged or bound row's: the benchmark's own
    arguments and call), jitted, as a function of nothing."""
    key = "ragged_bound" if bound else "ragged"
    inputs = prefill_bench.make_inputs(point, {key}, 1, jax.random.PRNGKey(seed))
    wl = dict(prefill_bench.sub_workloads(point))["ragged"]
    qs, tables, lens, arrays = prefill_bench.method_args(key, wl, inputs)
    ((_, attn, _),) = prefill_bench.candidates(key, point)
    call = jax.jit(attn)
    return lambda: call(qs[0], tables[0], lens, arrays)


def decode_call(point, seed=0):
    """An attention_bench point's call of the decode reader (its kernel row's), jitted, as a
    function of nothing."""
    inputs = attention_bench.make_inputs(point, ["kernel"], 1, jax.random.key(seed))
    call = jax.jit(attention_bench.nvfp4_attn("auto"))
    return lambda: call(inputs["qs"][0], inputs["tables"][0], inputs["lens"], inputs["arrays"])


def call_of(name, bound):
    """The function of nothing that makes point `name`'s call; SystemExit for an unknown name
    or --bound on a decode point."""
    point = find_point(name)
    if point is not None:
        return ragged_call(point, bound)
    point = attention_bench.named_point(name, 0)
    if point is None:
        known = ", ".join(spec[0] for spec in prefill_bench.FULL_POINTS
                          + prefill_bench.QUICK_POINTS)
        raise SystemExit(f"one_call.py: no point {name!r} (prefill_bench's: {known}, or "
                         "spec<B>x8; attention_bench's: BxC or raggedN)")
    if bound:
        raise SystemExit(f"one_call.py: --bound is for prefill_bench's points, not {name!r} "
                         "(one query token a sequence)")
    return decode_call(point)


def run(name, bound, calls):
    """Point `name`'s call run `calls` times: its last output (on the host)."""
    call = call_of(name, bound)
    out = None
    for _ in range(calls):
        out = call()
    return np.asarray(out.astype(jnp.float32))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", default="spec32x8",
                        help="a prefill_bench.py point (e.g. spec32x8, chunked8x512, spec2x8) "
                             "or an attention_bench.py one (e.g. 1x4096, ragged32)")
    parser.add_argument("--bound", action="store_true",
                        help="pass max_q_len = the point's longest query (the bound row)")
    parser.add_argument("--calls", type=int, default=2, help="calls run (at least 1)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    out = run(args.point, args.bound, args.calls)
    print(f"{args.point}{' (bound)' if args.bound else ''}: out {out.shape}, "
          f"mean |value| {float(np.abs(out).mean()):.6g}")


if __name__ == "__main__":
    main()
