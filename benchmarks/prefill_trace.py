"""Per-CTA timeline of the pipelined prefill kernel, or of the wide few-row kernel
(developers' tool; needs the trace variant's build: benchmarks/variants/prefill_trace.patch,
which adds _ffi._prefill_trace_take, or with ``--kernel wide`` wide_trace.patch, which adds
_ffi._wide_trace_take).

For one ragged call at each prefill_bench point it reads, per CTA of the kernel, the global
timer (ns, comparable across SMs) at its events and prints percentiles of the intervals between
them, and per SM the gaps between consecutive CTAs and the SMs' busy fraction of the call. It
answers where a CTA's fixed costs go, against its steps. The pipelined kernel
(ffi/ragged_pipelined.cu with the patch: kEntry ... kOut1): the prologue (CTA start to the unit
found, the first stage handed over by the producer, consumer 0's q staged and ready, the first
stage taken), the loop (per step), the epilogue (loop done to the rows written; since ragged
v25 it has no barrier: v24's trace had two more events, the consumers synced and the tile staged
in shared memory); on an H100 (benchmarks/NOTES.md) before ragged v24 ~12 us of prologue and
~12 us of epilogue a CTA, after v26 ~6.8 and ~1.3. The wide kernel (ffi/few_rows_wide.cuh with
the patch: kWideEntry ... kWideOut), at the speculative points with ``max_q_len`` (the bound
call, which launches it alone; other batch sizes with --spec-batches): the sequence found, q^T
staged with the first step landed, the loop, the rows' sums exchanged, warp 0's rows written
(benchmarks/NOTES.md, "Where it stands (end of the thirty-eighth session)": ~15-20 us a CTA
outside the steps by a fit).

    benchmarks/ab.sh --patch benchmarks/variants/prefill_trace.patch --a none --rounds 1 -- \\
        python3 -P benchmarks/prefill_trace.py --points chunked8x512,chunked1x2048
    benchmarks/ab.sh --patch benchmarks/variants/wide_trace.patch --a none --rounds 1 -- \\
        python3 -P benchmarks/prefill_trace.py --kernel wide --points spec32x8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import prefill_bench as pb  # noqa: E402  (this folder: the points and their inputs)

# The variant's layout: per CTA WORDS uint64: EVENTS global-timer ns (0: not reached), the SM,
# blockIdx.x, the CTA's step count. (The pipelined kernel's; Kernel below has each kernel's.)
TRACE_CTAS, EVENTS = 16384, 10
WORDS = EVENTS + 3
(ENTRY, FOUND, FIRST_STAGE, Q_STAGED, Q_READY, FIRST_FULL, PRODUCER_DONE, LOOP_DONE, OUT0,
 OUT1) = range(EVENTS)
SM, BLOCK, STEPS = EVENTS, EVENTS + 1, EVENTS + 2

#: (label, from event, to event) of the intervals printed, in a CTA's order.
INTERVALS = (
    ("start -> unit found", ENTRY, FOUND),
    ("start -> first stage handed over (producer)", ENTRY, FIRST_STAGE),
    ("start -> q staged (consumer 0)", ENTRY, Q_STAGED),
    ("start -> q ready (consumer 0)", ENTRY, Q_READY),
    ("start -> first stage taken (consumer 0)", ENTRY, FIRST_FULL),
    ("first stage taken -> loop done", FIRST_FULL, LOOP_DONE),
    ("producer done -> loop done", PRODUCER_DONE, LOOP_DONE),
    ("loop done -> rows written (consumer 0)", LOOP_DONE, OUT0),
)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A traced kernel: its variant (``_ffi._<script>_take``), its events' count, the
    intervals printed, the events that bound its loop of ``STEPS`` steps, the events whose
    latest is a CTA's end, and how prefill_bench's ragged call is made for it."""
    script: str
    name: str
    events: int
    intervals: tuple
    loop: tuple          # (loop start event, loop done event)
    outs: tuple          # a CTA's end: the latest of these (its start where none was reached)
    default_points: str
    bounded: bool        # the call with max_q_len (the speculative points' bound)

    @property
    def words(self):
        return self.events + 3


PIPELINED = Kernel("prefill_trace", "pipelined prefill kernel", EVENTS, INTERVALS,
                   (FIRST_FULL, LOOP_DONE), (OUT0, OUT1), "chunked8x512,chunked1x2048", False)

# The wide kernel's events (wide_trace.patch): thread 0's.
W_ENTRY, W_FOUND, W_Q_STAGED, W_LOOP_DONE, W_SUMMED, W_OUT = range(6)
WIDE = Kernel("wide_trace", "wide few-row kernel", 6, (
    ("start -> sequence found", W_ENTRY, W_FOUND),
    ("start -> q staged, first step landed", W_ENTRY, W_Q_STAGED),
    ("q staged -> loop done", W_Q_STAGED, W_LOOP_DONE),
    ("loop done -> sums exchanged", W_LOOP_DONE, W_SUMMED),
    ("sums exchanged -> rows written (warp 0)", W_SUMMED, W_OUT),
    ("loop done -> rows written (warp 0)", W_LOOP_DONE, W_OUT),
), (W_Q_STAGED, W_LOOP_DONE), (W_OUT,), "spec32x8", True)

KERNELS = {"pipelined": PIPELINED, "wide": WIDE}


def take(kernel=PIPELINED):
    return pb.ab.trace_take(kernel.script, TRACE_CTAS, kernel.words)


def spread(x):
    """p10 / p50 / p90 / mean of x (us)."""
    x = np.asarray(x, float)
    if x.size == 0:
        return "-"
    p10, p50, p90 = np.percentile(x, (10, 50, 90))
    return f"p10 {p10:8.2f}  p50 {p50:8.2f}  p90 {p90:8.2f}  mean {x.mean():8.2f}"


def end_of(t, kernel=PIPELINED):
    """Each CTA's end: its last rows written (the pipelined kernel: of either consumer), else
    its start (an early return)."""
    end = t[:, list(kernel.outs)].max(axis=1)
    return np.where(end == 0, t[:, ENTRY], end)


def describe(t, kernel=PIPELINED):
    """Prints the summary of one launch's trace rows (the CTAs that started)."""
    sm, steps = kernel.events, kernel.events + 2
    first, done = kernel.loop
    start0 = t[:, ENTRY].min()
    ends = end_of(t, kernel)
    span = ends.max() - start0
    work = t[:, done] != 0
    sms = np.unique(t[:, sm])
    print(f"  {len(t)} CTAs ({int(work.sum())} with steps) on {len(sms)} SMs; first start to "
          f"last end {span / 1e3:.1f} us")
    w = t[work]
    if len(w):
        print(f"  steps a CTA: {spread(w[:, steps])}")
        for label, a, b in kernel.intervals:
            ok = (w[:, a] != 0) & (w[:, b] != 0)
            print(f"  {label:45s} {spread((w[ok, b] - w[ok, a]) / 1e3)} us")
        per_step = (w[:, done] - w[:, first]) / np.maximum(w[:, steps], 1)
        print(f"  {'per step (the loop over its steps)':45s} {spread(per_step / 1e3)} us")
        life = (end_of(w, kernel) - w[:, ENTRY]) / 1e3
        print(f"  {'start -> end':45s} {spread(life)} us")
    gaps, busy = [], 0
    for one in sms:
        rows = t[t[:, sm] == one]
        order = np.argsort(rows[:, ENTRY])
        starts, stops = rows[order, ENTRY], end_of(rows[order], kernel)
        busy += int((stops - starts).sum())
        gaps.extend(((starts[1:] - stops[:-1]) / 1e3).tolist())
    print(f"  {'gap between CTAs on an SM':45s} {spread(gaps)} us ({len(gaps)} gaps)")
    print(f"  SMs busy: {busy / max(len(sms) * span, 1):.3f} of the SMs x the call")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="pipelined",
                        help="the traced kernel (its variant's build)")
    parser.add_argument("--points", default=None,
                        help="prefill_bench points, comma-separated (default: the kernel's: "
                        f"pipelined {PIPELINED.default_points}, wide {WIDE.default_points})")
    parser.add_argument("--launches", type=int, default=2, help="launches traced per point")
    pb.add_spec_batches(parser)
    args = parser.parse_args(argv)
    kernel = KERNELS[args.kernel]
    refusal = pb.ab.trace_refusal(kernel.script, kernel.name)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    points = {p["name"]: p for p in pb.make_points(False, args.spec_batches)}
    for name in (args.points or kernel.default_points).split(","):
        point = points[name]
        inputs = pb.make_inputs(point, ["ragged"], 2, jax.random.PRNGKey(0))
        qs, tables, lens, arrays = pb.method_args("ragged", dict(pb.sub_workloads(point))["ragged"],
                                                  inputs)
        bound = int(point["q_lens"].max()) if kernel.bounded else None
        attn = jax.jit(functools.partial(pb.ragged_attn, max_q_len=bound))
        for i in range(3):                     # compile, warm
            jax.block_until_ready(attn(qs[i % 2], tables[i % 2], lens, arrays))
        for launch in range(args.launches):
            take(kernel)                       # clear what earlier launches left
            jax.block_until_ready(attn(qs[launch % 2], tables[launch % 2], lens, arrays))
            t = take(kernel)
            print(f"{name}, launch {launch + 1}:")
            describe(t[t[:, ENTRY] != 0], kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
