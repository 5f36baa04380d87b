"""Benchmark of the NVFP4 store against what a JAX user has without it, and the memory ceiling.

    python benchmarks/store_bench.py                 # the full table (GPU); writes JSON + PNG
    python benchmarks/store_bench.py --quick         # a small smoke run (works on CPU)

Timing method: device time per call from chained calls. Each method's call is chained n times
in ONE compiled program (the cache threads through every call, so XLA can neither fuse nor drop
them; every call gets its own slot_mapping). The program runs with the cache donated; its wall
time is measured after block_until_ready, median of several runs, for two chain lengths n1 < n2.
Per call = (t(n2) - t(n1)) / (n2 - n1): the program's fixed cost (dispatch, the first launch)
cancels, what remains is the device time of one call plus its share of launch gaps inside
the program. Calls of at most --device-time-max-tokens tokens (256) are also timed from a
profiler trace of the longer chain (compiled without command buffers): the self time of its
kernels' events summed, over n2 (the "kernels' µs" column): no launch gaps, the time the issue
asks the small stores to be compared by.

Bytes per call: K and V read (2 * tokens * heads * head_size * 2 bytes for bf16) plus the cache
bytes written (tokens * heads * 2 * F for NVFP4, F = head_size * 9 / 16; 2 bytes per element for
the bf16 cache, 1 for fp8). Ceiling: the better of a device-to-device copy of a >= 1 GiB buffer
and an in-place elementwise pass over it, counting bytes read + written, each timed as many
calls queued back to back (again the difference of two counts).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_nvfp4  # noqa: E402
from jax_nvfp4 import layout as nv_layout  # noqa: E402
from jax_nvfp4 import reference as nv_reference  # noqa: E402

GiB = 1 << 30


def _ready(x):
    jax.block_until_ready(x)
    return x


# ---------------------------------------------------------------------------------------------
# What every benchmark (this one, attention_bench.py, prefill_bench.py) says about where it ran
# and where its output went.

def on_gpu():
    return jax.devices()[0].platform == "gpu"


def smoke_run_note():
    """The line a run off a GPU prints first, once."""
    platform = jax.devices()[0].platform
    return (f"NOTE: this ran on {platform}, not on a GPU: a smoke run. Its times are those of "
            f"the {platform} code paths (the NVFP4 readers' jnp path, the store's C++ kernel, "
            f"XLA's {platform} ops) and mean nothing for a GPU; the GPU targets and the shares "
            f"of the memory ceiling are left out.")


def kernel_label(gpu_label, elsewhere):
    """The row label of a method whose kernel runs only on a GPU: ``gpu_label`` there, else
    ``elsewhere`` (what ran instead; ``{platform}`` is filled in)."""
    return gpu_label if on_gpu() else elsewhere.format(platform=jax.devices()[0].platform)


def rate_text(bytes_per_s):
    return (f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e12
            else f"{bytes_per_s / 1e9:.1f} GB/s")


def write_outputs(out_dir, name, result, text, plot, json_default=None):
    """Writes ``name``.json (result), .md (text) and .png (``plot(result, path)``, which needs
    matplotlib) into ``out_dir`` and prints where they went."""
    written = []
    for suffix, content in (("json", json.dumps(result, indent=1, default=json_default)),
                            ("md", text + "\n")):
        path = os.path.join(out_dir, f"{name}.{suffix}")
        with open(path, "w") as f:
            f.write(content)
        written.append(path)
    missing = None
    try:
        plot(result, os.path.join(out_dir, f"{name}.png"))
        written.append(os.path.join(out_dir, f"{name}.png"))
    except ImportError:
        missing = ("no plot: matplotlib is not installed (pip install matplotlib, or the "
                   "package's bench extra: pip install \".[bench]\")")
    print(f"\nwrote {', '.join(written)}", flush=True)
    if missing:
        print(missing, flush=True)


def _time_program(fn, state, args, repeats):
    """Median wall time of fn(state, *args) (state donated and threaded through)."""
    state = _ready(fn(state, *args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = _ready(fn(state, *args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def _chain(step, n):
    """One program of n chained calls of step (the state donated and threaded through)."""
    def program(state, calls):
        for args in calls[:n]:
            state = step(state, *args)
        return state

    return jax.jit(program, donate_argnums=0)


def chained_time(step, state, per_call_args, n1, n2, repeats, attempts=3):
    """Device seconds per call of step(state, *args_i), by the difference of two chain lengths.

    per_call_args: a list of at least n2 argument tuples (one per chained call). The two
    chains are timed again where their difference is not positive (``_per_call``).
    """
    short, long = _chain(step, n1), _chain(step, n2)  # compiled once, on the first attempt

    def timed_pair():
        nonlocal state
        t1, state = _time_program(short, state, (per_call_args[:n1],), repeats)
        t2, state = _time_program(long, state, (per_call_args[:n2],), repeats)
        return t1, t2

    return _per_call(timed_pair, n1, n2, attempts), state


def _per_call(timed_pair, n1, n2, attempts):
    """Seconds per call from timed_pair() -> (time of n1 calls, time of n2 calls): their
    difference over n2 - n1. A difference that is not positive (the host's noise larger than
    what the longer run adds) is measured again, up to ``attempts`` pairs in all; NaN if none
    came out positive, never a time of 0 or below."""
    for _ in range(attempts):
        t1, t2 = timed_pair()
        if t2 > t1:
            return (t2 - t1) / (n2 - n1)
    return float("nan")


# ---------------------------------------------------------------------------------------------
# Device time from a profiler trace: the kernels' own time, launch gaps left out (the small
# stores, where chain differences are noisier than what they compare; serving_bench.py's split
# of a decode step).

# Programs compiled for a trace run without XLA's command buffers (CUDA graphs): inside one,
# every kernel's event names the command buffer, not its instruction (H200, jax 0.11.2).
PROFILE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def self_times(events):
    """[(start, end, payload)] on one timeline -> [(self time, payload)]: an event's duration
    less the events nested in it (a while loop's body, a call)."""
    out, stack = [], []
    for start, end, payload in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][1] <= start:
            stack.pop()
        out.append([end - start, payload])
        if stack:
            stack[-1][2][0] -= min(end, stack[-1][1]) - start
        stack.append((start, end, out[-1]))
    return [(max(t, 0), p) for t, p in out]


def op_timelines(xplane_path, module_name=None):
    """{(plane, line): [(start_ns, end_ns, hlo op)]} of a trace's op events (of the module whose
    name starts with module_name, where given: an event that names no module is taken), on the
    device's streams where there are any (XLA's derived timelines repeat their kernels), else on
    the device's lines, else on any."""
    from jax.profiler import ProfileData

    lines = {}
    for plane in ProfileData.from_file(xplane_path).planes:
        for line in plane.lines:
            events = []
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op")
                module = str(stats.get("hlo_module", ""))
                if op is None or (module_name and module and not module.startswith(module_name)):
                    continue
                events.append((ev.start_ns, ev.start_ns + ev.duration_ns, str(op)))
            if events:
                lines[(plane.name, line.name)] = events
    device = {k: v for k, v in lines.items() if k[0].startswith("/device:")}
    streams = {k: v for k, v in device.items() if k[1].lower().startswith("stream")}
    return streams or device or lines


def traced(run):
    """run() under jax.profiler.trace: (its result, the trace's .xplane.pb bytes' path in a
    folder that lives until the caller is done: a TemporaryDirectory, or None where no trace
    was written)."""
    folder = tempfile.TemporaryDirectory()
    with jax.profiler.trace(folder.name):
        result = run()
    paths = glob.glob(os.path.join(folder.name, "**", "*.xplane.pb"), recursive=True)
    return result, (folder, paths[0]) if paths else None


def kernels_time(program, state, args, n):
    """Device seconds per call of ``program(state, *args) -> state``, a chain of n calls
    compiled with PROFILE_COMPILER_OPTIONS, from the kernels' events in a profiler trace of one
    run after a warm one (their self times summed; None where the trace has no op events), and
    the state after. Also attention_bench.py's and prefill_bench.py's kernels' column."""
    state = _ready(program(state, *args))  # warm
    state, trace = traced(lambda: _ready(program(state, *args)))
    if trace is None:
        return None, state
    folder, path = trace
    with folder:
        total_ns = sum(t for events in op_timelines(path).values() for t, _ in self_times(events))
    return (total_ns * 1e-9 / n if total_ns > 0 else None), state


def profiled_chain_time(step, state, per_call_args, n):
    """kernels_time of a chain of n calls of step (this benchmark's), and the state."""
    program = _chain(step, n).lower(state, per_call_args[:n]).compile(PROFILE_COMPILER_OPTIONS)
    return kernels_time(program, state, (per_call_args[:n],), n)


def chain_lengths(step, state, per_call_args, target_s):
    """Picks n1 < n2 so that the longer chain runs for about target_s."""
    one = jax.jit(lambda s, *a: step(s, *a), donate_argnums=0)
    state = _ready(one(state, *per_call_args[0]))
    t0 = time.perf_counter()
    state = _ready(one(state, *per_call_args[0]))
    single = time.perf_counter() - t0  # an over-estimate: includes dispatch
    n2 = int(min(max(target_s / max(single, 1e-6), 8), 200))
    return 2, n2, state


# ---------------------------------------------------------------------------------------------
# The methods: each returns (step(state, key, value, slots) -> state, initial state, bytes/call).

def nvfp4_method(scale_search, num_blocks, block_size, heads, head_size, k_scale, v_scale,
                 store=jax_nvfp4.reshape_and_cache):
    def step(cache, key, value, slots):
        return store(key, value, cache, slots, k_scale, v_scale, layout="HND",
                     scale_search=scale_search, v_scale_swizzle=True)

    cache = jax_nvfp4.allocate_kv_cache(num_blocks, block_size, heads, head_size)
    return step, cache


def reference_method(scale_search, *args):
    """The jnp reference. Its quantisation does not depend on the cache, so in a chain of calls
    with the same key/value XLA would compute it once for all (common subexpressions; it did,
    until 2026-12-01), or run the calls' quantisations side by side on several cores, which a
    decode loop cannot. So each call first flips the lowest bit of its inputs by a bit of its
    own slot_mapping and one of the previous call's cache (an elementwise op that XLA fuses
    into the quantisation): no two calls are alike, and each waits for the one before."""

    def store(key, value, cache, slots, *rest, **options):
        flip = ((slots[0] ^ cache.reshape(-1)[0].astype(slots.dtype)) & 1).astype(jnp.uint16)
        key, value = (jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(x, jnp.uint16) ^ flip, x.dtype) for x in (key, value))
        return nv_reference.reshape_and_cache(key, value, cache, slots, *rest, **options)

    return nvfp4_method(scale_search, *args, store=store)


def dense_method(dtype, num_blocks, block_size, heads, head_size, k_scale, v_scale,
                 unique_indices=False):
    """A donated paged cache [num_blocks, 2, block_size, heads, head_size] in bf16 or fp8,
    updated with .at[].set: what a JAX user writes today. ``unique_indices=True`` promises XLA
    that no two tokens share a slot (true of every slot_mapping here), so that its scatter needs
    no atomics: the best a competent user writes without a custom kernel."""

    def step(cache, key, value, slots):
        block, row = slots // block_size, slots % block_size
        if dtype == jnp.bfloat16:
            k, v = key, value
        else:  # per-tensor fp8 with saturation (a plain astype would turn overflow into NaN)
            k = jnp.clip(key.astype(jnp.float32) / k_scale, -448, 448).astype(dtype)
            v = jnp.clip(value.astype(jnp.float32) / v_scale, -448, 448).astype(dtype)
        cache = cache.at[block, 0, row].set(k, mode="drop", unique_indices=unique_indices)
        return cache.at[block, 1, row].set(v, mode="drop", unique_indices=unique_indices)

    cache = jnp.zeros((num_blocks, 2, block_size, heads, head_size), dtype)
    return step, cache


def store_bytes(tokens, heads, head_size, method):
    read = 2 * tokens * heads * head_size * 2
    if method.startswith("nvfp4") or method.startswith("jnp reference"):
        written = 2 * tokens * heads * nv_layout.head_bytes(head_size)
    elif method.startswith("bf16"):
        written = 2 * tokens * heads * head_size * 2
    else:
        written = 2 * tokens * heads * head_size
    return read + written


def make_inputs(rng, tokens, heads, head_size, num_blocks, block_size, n_calls):
    key = jnp.asarray(rng.standard_normal((tokens, heads, head_size), np.float32), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((tokens, heads, head_size), np.float32), jnp.bfloat16)
    pages_needed = -(-tokens // block_size)
    slot_sets = []
    for _ in range(n_calls):
        # Prefill-like: the tokens fill whole pages, the pages are scattered over the cache.
        pages = rng.choice(num_blocks, size=pages_needed, replace=False)
        slots = (pages[:, None] * block_size + np.arange(block_size)).reshape(-1)[:tokens]
        slot_sets.append(jnp.asarray(slots, jnp.int32))
    return key, value, slot_sets


# ---------------------------------------------------------------------------------------------

def _async_time(fn, x, n1, n2, repeats, attempts=3, rewind=None):
    """Device seconds per fn call: n calls queued back to back (dispatch is asynchronous, so the
    host stays ahead of the device when one call takes far longer than its dispatch), for two n
    (``_per_call``: measured again where the difference is not positive, NaN if it never is).
    ``rewind(x)``, where given, is applied before each attempt after the first (a decode
    state whose room for new tokens covers one attempt's calls)."""

    def run(n, x):
        t0 = time.perf_counter()
        for _ in range(n):
            x = fn(x)
        _ready(x)
        return time.perf_counter() - t0, x

    attempt = 0

    def timed_pair():
        nonlocal x, attempt
        if attempt and rewind is not None:
            x = rewind(x)
        attempt += 1
        t = {}
        for n in (n1, n2):
            samples = []
            for _ in range(repeats):
                dt, x = run(n, x)
                samples.append(dt)
            t[n] = statistics.median(samples)
        return t[n1], t[n2]

    x = _ready(fn(x))
    return _per_call(timed_pair, n1, n2, attempts), x


def measure_ceiling(nbytes, repeats):
    """Bytes moved per second (read + write) by the better of two passes over nbytes of device
    memory: a device-to-device copy (jax.device_put without aliasing) and an in-place
    elementwise pass (a compiled x ^ 1 with x donated), each its own program."""
    x = jnp.arange(nbytes // 4, dtype=jnp.uint32)
    copy_s, x = _async_time(lambda a: jax.device_put(a, a.sharding, may_alias=False), x, 2, 8,
                            repeats)
    flip = jax.jit(lambda a: a ^ jnp.uint32(1), donate_argnums=0)
    pass_s, x = _async_time(flip, x, 2, 8, repeats)
    del x
    copy, elementwise = 2 * nbytes / copy_s, 2 * nbytes / pass_s
    return {"elementwise_Bps": elementwise, "device_put_copy_Bps": copy,
            "ceiling_Bps": max(elementwise, copy), "bytes": nbytes}


def cache_blocks_for(cache_bytes, block_size, heads, head_size):
    return max(1, cache_bytes // (2 * heads * block_size * nv_layout.head_bytes(head_size)))


def run(args):
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
          f"date {time.strftime('%Y-%m-%d')}", flush=True)
    gpu = on_gpu()
    if not gpu:
        print(smoke_run_note(), flush=True)
    ceiling = measure_ceiling(args.ceiling_bytes, args.repeats)
    ceil_bps = ceiling["ceiling_Bps"]
    print(f"ceiling: elementwise {rate_text(ceiling['elementwise_Bps'])}, device_put copy "
          f"{rate_text(ceiling['device_put_copy_Bps'])} over {args.ceiling_bytes / GiB:.1f} GiB",
          flush=True)

    configs = []
    for heads in args.heads:
        for tokens in args.tokens:
            configs.append((tokens, heads, 128))
    for head_size in args.extra_head_sizes:
        configs.append((args.extra_tokens, args.heads[0], head_size))

    block_size = 16
    rows = []
    for tokens, heads, head_size in configs:
        # A cache twice the tokens (at least 64 pages): slots spread over it.
        num_blocks = max(2 * -(-tokens // block_size), 64)
        key, value, slot_sets = make_inputs(rng, tokens, heads, head_size, num_blocks, block_size,
                                            args.max_chain)
        k_scale = jnp.max(jnp.abs(key.astype(jnp.float32))) / 448
        v_scale = jnp.max(jnp.abs(value.astype(jnp.float32))) / 448
        geometry = (num_blocks, block_size, heads, head_size, k_scale, v_scale)
        methods = {
            "nvfp4 default": lambda: nvfp4_method("default", *geometry),
            "nvfp4 4over6": lambda: nvfp4_method("4over6", *geometry),
            "jnp reference (jit)": lambda: reference_method("default", *geometry),
            "bf16 .at[].set": lambda: dense_method(jnp.bfloat16, *geometry),
            "bf16 .at[].set unique": lambda: dense_method(jnp.bfloat16, *geometry,
                                                          unique_indices=True),
            "fp8 .at[].set": lambda: dense_method(jnp.float8_e4m3fn, *geometry),
        }
        if tokens > args.reference_max_tokens:
            methods.pop("jnp reference (jit)")
        if args.methods:
            methods = {k: v for k, v in methods.items()
                       if any(k.startswith(m) for m in args.methods)}
        for name, make in methods.items():
            step, state = make()
            # The reference is a large program per call: a short chain keeps compiles quick.
            calls = [(key, value, s) for s in slot_sets][:16 if name.startswith("jnp") else None]
            n1, n2, state = chain_lengths(step, state, calls, args.target_seconds)
            per_call, state = chained_time(step, state, calls, n1, min(n2, len(calls)),
                                           args.repeats)
            kernels_s = None
            if tokens <= args.device_time_max_tokens:
                kernels_s, state = profiled_chain_time(step, state, calls, min(n2, len(calls)))
            del state
            nbytes = store_bytes(tokens, heads, head_size, name)
            row = {"tokens": tokens, "kv_heads": heads, "head_size": head_size, "method": name,
                   "us_per_call": per_call * 1e6, "bytes": nbytes,
                   "GBps": nbytes / per_call / 1e9 if per_call > 0 else float("nan"),
                   "device_us_per_call": None if kernels_s is None else kernels_s * 1e6}
            # Off a GPU the "ceiling" is a host memory copy: a share of it says nothing.
            row["pct_ceiling"] = 100 * row["GBps"] * 1e9 / ceil_bps if gpu else None
            rows.append(row)
            share = f" {row['pct_ceiling']:>6.1f}% of ceiling" if gpu else ""
            if kernels_s is not None:
                share += f"  (profiler: {kernels_s * 1e6:.2f} us of kernels a call)"
            print(f"{tokens:>7} tok {heads:>2} heads D={head_size:<3} {name:<20} "
                  f"{row['us_per_call']:>10.2f} us {row['GBps']:>8.1f} GB/s{share}", flush=True)

    size_rows = []
    for cache_bytes in args.cache_sizes:
        tokens, heads, head_size = args.size_tokens, args.heads[0], 128
        num_blocks = cache_blocks_for(cache_bytes, block_size, heads, head_size)
        key, value, slot_sets = make_inputs(rng, tokens, heads, head_size, num_blocks, block_size,
                                            args.max_chain)
        k_scale = jnp.max(jnp.abs(key.astype(jnp.float32))) / 448
        step, cache = nvfp4_method("default", num_blocks, block_size, heads, head_size,
                                   k_scale, k_scale)
        calls = [(key, value, s) for s in slot_sets]
        per_call, cache = chained_time(step, cache, calls, 2, args.max_chain, args.repeats)
        size_rows.append({"cache_bytes": int(cache.nbytes), "tokens": tokens,
                          "us_per_call": per_call * 1e6})
        print(f"cache {cache.nbytes / GiB:6.2f} GiB: store of {tokens} tokens "
              f"{per_call * 1e6:.2f} us", flush=True)
        del cache

    return {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "ceiling": ceiling, "rows": rows,
            "cache_size_rows": size_rows, "method_note": __doc__.split("\n\n")[1]}


def markdown(result):
    c = result["ceiling"]
    lines = [f"Device: {result['device']}, jax {result['jax']}, {result['date']}. Ceiling "
             f"{rate_text(c['ceiling_Bps'])} (read + write; elementwise "
             f"{rate_text(c['elementwise_Bps'])}, device_put copy "
             f"{rate_text(c['device_put_copy_Bps'])}).", "",
             "| tokens | kv heads | head size | method | µs / call | kernels' µs / call (profiler) "
             "| GB/s | % of ceiling |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        share = "-" if r["pct_ceiling"] is None else f"{r['pct_ceiling']:.1f}"
        device = r.get("device_us_per_call")
        device = "-" if device is None else f"{device:.2f}"
        lines.append(f"| {r['tokens']} | {r['kv_heads']} | {r['head_size']} | {r['method']} | "
                     f"{r['us_per_call']:.2f} | {device} | {r['GBps']:.1f} | {share} |")
    if result["cache_size_rows"]:
        lines += ["", "| cache size | tokens stored | µs / call |", "| ---: | ---: | ---: |"]
        for r in result["cache_size_rows"]:
            lines.append(f"| {r['cache_bytes'] / GiB:.2f} GiB | {r['tokens']} | "
                         f"{r['us_per_call']:.2f} |")
    return "\n".join(lines)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for heads in sorted({r["kv_heads"] for r in result["rows"]}):
        for method in dict.fromkeys(r["method"] for r in result["rows"]):
            rs = [r for r in result["rows"] if r["kv_heads"] == heads and r["method"] == method
                  and r["head_size"] == 128]
            if not rs:
                continue
            x = [r["tokens"] for r in rs]
            style = "-" if heads == 8 else "--"
            axes[0].plot(x, [r["us_per_call"] for r in rs], style, marker="o",
                         label=f"{method}, {heads} heads")
            axes[1].plot(x, [np.nan if r["pct_ceiling"] is None else r["pct_ceiling"]
                             for r in rs], style, marker="o", label=f"{method}, {heads} heads")
    axes[0].set(xscale="log", yscale="log", xlabel="tokens per call", ylabel="µs per call",
                title=f"store time ({result['device']})")
    axes[1].set(xscale="log", xlabel="tokens per call", ylabel="% of measured copy ceiling",
                title="effective bandwidth / ceiling")
    axes[1].axhline(85, color="gray", lw=0.8)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run, e.g. on CPU)")
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON, table and PNG")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--target-seconds", type=float, default=0.02)
    p.add_argument("--tokens", type=int, nargs="*", help="override the token counts")
    p.add_argument("--heads", type=int, nargs="*", help="override the kv head counts")
    p.add_argument("--methods", nargs="*", help="only methods whose name starts with one of these")
    p.add_argument("--head-sizes", type=int, nargs="*",
                   help="head sizes besides 128, each at 32768 tokens (--quick: 256) and the "
                        "first kv head count (default 64 256, --quick 64; --tokens or --heads "
                        "drop them unless this is given; empty: none)")
    p.add_argument("--no-cache-sizes", action="store_true", help="skip the 1 vs 64 GiB cache test")
    p.add_argument("--device-time-max-tokens", type=int, default=256,
                   help="also time the calls of at most this many tokens from a profiler trace "
                        "(the kernels' own time; 0: none)")
    args = p.parse_args(argv)
    overrides = {"tokens": args.tokens, "heads": args.heads}
    if args.quick:
        args.tokens, args.heads, args.extra_head_sizes, args.extra_tokens = [1, 16, 256], [8], [64], 256
        args.cache_sizes, args.size_tokens = [8 << 20, 64 << 20], 256
        args.ceiling_bytes, args.reference_max_tokens, args.max_chain = 64 << 20, 1 << 30, 12
        args.repeats = 3
    else:
        args.tokens = [1, 16, 256, 4096, 32768, 131072]
        args.heads, args.extra_head_sizes, args.extra_tokens = [8, 32], [64, 256], 32768
        args.cache_sizes, args.size_tokens = [1 * GiB, 64 * GiB], 4096
        args.ceiling_bytes, args.reference_max_tokens, args.max_chain = 2 * GiB, 1 << 30, 200
    for name, value in overrides.items():
        if value:
            setattr(args, name, value)
            args.extra_head_sizes = []
    if args.head_sizes is not None:
        args.extra_head_sizes = args.head_sizes
    if args.no_cache_sizes:
        args.cache_sizes = []
    os.makedirs(args.out, exist_ok=True)
    result = run(args)
    table = markdown(result)
    write_outputs(args.out, "store_bench", result, table, plot)
    print()
    print(table, flush=True)
    return result


if __name__ == "__main__":
    main()
