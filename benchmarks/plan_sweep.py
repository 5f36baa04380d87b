"""prefill_bench.py with the split plan of the few-row kernels' calls forced (a developers' sweep).

    python3 -P benchmarks/plan_sweep.py --splits 2 --points spec32x8 --only ragged --repeats 3
    for s in 1 2 3 4 6; do python3 -P benchmarks/plan_sweep.py --splits $s --points spec32x8 \
        --only ragged --out /tmp/sw$s; done

Where the few-row kernels serve a ragged call alone (a bound ``max_q_len``: speculative
decoding's verify step, prefill_bench's "max_q_len = q" row), ``ragged_primitive.plan_splits``
picks the split-KV plan from a model of waves (``attention_primitive.plan_splits_for_units``).
The model counts a resident CTA as fast whatever else shares its SM, which the wide kernel's
timings say it is not (the thirty-eighth session's fit, benchmarks/NOTES.md: a step ~20% slower
at three CTAs a SM than at two). This runs the benchmark with that plan
replaced by ``--splits`` splits of equal length (a multiple of the kernel's 64-position step),
so that the model's choice can be measured against its neighbours in one lease, one process per
plan. Every other call keeps its plan; each planned call prints its plan ("plan_sweep: ...").
Everything after ``--splits N`` goes to prefill_bench.py unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_nvfp4.attention_primitive as attention_primitive  # noqa: E402
import jax_nvfp4.ragged_primitive as ragged_primitive  # noqa: E402


def forced_plan(max_tokens: int, splits: int) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)`` of about ``splits`` equal splits of ``max_tokens``
    positions, each a multiple of the kernels' step (so fewer where the last would be empty):
    the planner's own cut (``attention_primitive.split_evenly``) at a count of our choosing."""
    return attention_primitive.split_evenly(max_tokens, max(splits, 1), ragged_primitive.KV_TILE)


def force_splits(splits: int):
    """Replaces ``ragged_primitive.plan_splits`` (looked up at each call's trace) by one that
    plans ``splits`` splits where the few-row kernels serve the call alone (``alone=True``) and
    the model's plan elsewhere; returns the original, to put back."""
    original = ragged_primitive.plan_splits

    def plan(stacked, num_tokens, max_num_seqs, num_kv_heads, num_q_heads, head_size,
             max_tokens, *args, **kwargs):
        model = original(stacked, num_tokens, max_num_seqs, num_kv_heads, num_q_heads,
                         head_size, max_tokens, *args, **kwargs)
        chosen = forced_plan(max_tokens, splits) if kwargs.get("alone") else model
        print(f"plan_sweep: {max_num_seqs} sequences x {num_kv_heads} kv heads over "
              f"{max_tokens} positions, alone={bool(kwargs.get('alone'))}: model {model}, "
              f"run {chosen}", flush=True)
        return chosen

    ragged_primitive.plan_splits = plan
    return original


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    p.add_argument("--splits", type=int, required=True,
                   help="splits of the few-row kernels' calls (the rest: prefill_bench.py's)")
    args, rest = p.parse_known_args(argv)
    if args.splits < 1:
        p.error("--splits must be at least 1")
    force_splits(args.splits)
    import prefill_bench
    return prefill_bench.main(rest)


if __name__ == "__main__":
    main()
