"""benchmarks/prefill_trace.py without a GPU: its summary of a made-up trace (the variant's word
layout: per CTA the global-timer ns of each event, then the SM, blockIdx.x and the step count).
Its refusal on a build without the trace: tests/test_decode_trace_script.py."""

from __future__ import annotations

import numpy as np

from scripts import load_script

trace = load_script("benchmarks/prefill_trace.py", "prefill_trace_script")


def trace_row(kernel, start, at_us, sm, block, steps):
    """One CTA's words of `kernel`'s trace: event e at `start` + at_us[e] us (ns), then the SM,
    blockIdx.x and step count."""
    row = np.zeros(kernel.words, np.int64)
    for event, us in at_us.items():
        row[event] = start + int(1000 * us)
    row[kernel.events], row[kernel.events + 1], row[kernel.events + 2] = sm, block, steps
    return row


def summary(capsys, t, kernel=trace.PIPELINED, medians=()):
    """describe's output for trace rows t, after checking that the line of each label in
    `medians` has that median (us)."""
    trace.describe(t, kernel)
    out = capsys.readouterr().out
    lines = {line.split("  p10")[0].strip(): line for line in out.splitlines() if "p50" in line}
    for label, us in dict(medians).items():
        assert f"p50 {us:8.2f}" in lines[label], (label, out)
    return out


def cta(start, sm, block, steps=100):
    """A CTA of `steps` steps of 2 us from `start` (ns): found after 1 us, first stage handed
    over at 5, q staged at 8 and ready at 9, first stage taken at 10, the producer done at 200,
    the loop at 210, consumer 0's rows written at 216 (consumer 1's at 215)."""
    return trace_row(trace.PIPELINED, start, {
        trace.ENTRY: 0, trace.FOUND: 1, trace.FIRST_STAGE: 5, trace.Q_STAGED: 8,
        trace.Q_READY: 9, trace.FIRST_FULL: 10, trace.PRODUCER_DONE: 200,
        trace.LOOP_DONE: 10 + 2 * steps, trace.OUT0: 16 + 2 * steps,
        trace.OUT1: 15 + 2 * steps}, sm, block, steps)


def test_the_summary_of_a_made_up_trace(capsys):
    t0 = 1_000_000_000
    early = np.zeros(trace.WORDS, np.int64)   # a CTA past the last pair: start and found only
    early[trace.ENTRY], early[trace.FOUND], early[trace.SM] = t0 + 100, t0 + 400, 1
    # SM 0: one gap of 0.5 us between its two CTAs; SM 1's early CTA is busy for no time.
    out = summary(capsys, np.stack([cta(t0, 0, 0), cta(t0 + 216_500, 0, 2), early]), medians={
        "start -> unit found": 1, "start -> first stage taken (consumer 0)": 10,
        "first stage taken -> loop done": 200, "per step (the loop over its steps)": 2,
        "loop done -> rows written (consumer 0)": 6, "start -> end": 216,
        "gap between CTAs on an SM": 0.5})
    assert "3 CTAs (2 with steps) on 2 SMs; first start to last end 432.5 us" in out, out
    assert "steps a CTA: p10   100.00  p50   100.00" in out, out
    assert "(1 gaps)" in out, out
    assert "SMs busy: 0.499 of the SMs x the call" in out, out


def wide_cta(start, sm, block, steps=128):
    """A wide-kernel CTA of `steps` steps of 1.5 us from `start` (ns): the sequence found after
    0.5 us, q staged at 4, the loop done 192 us later, the sums exchanged 1 us after it and warp
    0's rows written 2 us after that."""
    loop = 4 + 1.5 * steps
    return trace_row(trace.WIDE, start, {
        trace.W_ENTRY: 0, trace.W_FOUND: 0.5, trace.W_Q_STAGED: 4, trace.W_LOOP_DONE: loop,
        trace.W_SUMMED: loop + 1, trace.W_OUT: loop + 3}, sm, block, steps)


def test_the_wide_kernels_summary_of_a_made_up_trace(capsys):
    t0 = 2_000_000_000
    nothing = np.zeros(trace.WIDE.words, np.int64)  # a fill CTA: its start only
    nothing[trace.W_ENTRY], nothing[trace.WIDE.events] = t0 + 50, 1
    # SM 1: the fill CTA (start only, at +0.05 us) then the second CTA (at +1 us): one gap.
    out = summary(capsys, np.stack([wide_cta(t0, 0, 0), wide_cta(t0 + 1000, 1, 8), nothing]),
                  trace.WIDE, medians={
                      "start -> sequence found": 0.5, "start -> q staged, first step landed": 4,
                      "q staged -> loop done": 192, "per step (the loop over its steps)": 1.5,
                      "loop done -> sums exchanged": 1, "loop done -> rows written (warp 0)": 3,
                      "start -> end": 199, "gap between CTAs on an SM": 0.95})
    assert "3 CTAs (2 with steps) on 2 SMs; first start to last end 200.0 us" in out, out
    assert "(1 gaps)" in out, out

