"""Static SASS counts of the CUDA kernels, as benchmarks/NOTES.md counts them before a GPU run.

    python benchmarks/sass_counts.py ffi/decode_cuda.cu
    python benchmarks/sass_counts.py ffi/decode_cuda.cu --loop DecodeKernelILi128ELb1ELNS_6LayoutE0
    python benchmarks/sass_counts.py ffi/decode_cuda.cu --patch benchmarks/variants/X.patch --loop K
    python benchmarks/sass_counts.py ffi/store_cuda.cu -D NVFP4_STORE_4OVER6_MIN_CTAS=2
    python benchmarks/sass_counts.py ffi/ragged_few_rows.cu --loop WideRowsKernelILb1ELNS_6LayoutE0 --innermost

Compiles one file of ``ffi/`` for sm_90a with the build's flags (CMakeLists.txt: ``--fmad=false
--ftz=true``, C++17, ``-O3``; nvcc from PATH, the XLA FFI headers from jaxlib) into a cubin,
disassembles it (``cuobjdump -sass``: the CUDA toolkit's, or pip's ``nvidia-cuda-cuobjdump``),
and prints every kernel's registers, spill bytes (ptxas ``-v``) and static instructions, and
whether ptxas serialised its ``wgmma`` (see :func:`serialized_wgmma`). With
``--patch`` it compiles a copy of the tree with the patch applied (a variant of
``benchmarks/variants/``); ``--sass FILE`` reads a saved disassembly instead of compiling.

``--live`` adds each kernel's live registers (``nvdisasm --print-life-ranges``: the general
registers live at each instruction), and with ``--loop`` the loop's peak and where it is: what
the register budget of a launch bound has to hold (ragged v36 and v37, benchmarks/NOTES.md).

``--scoreboards`` (with ``--loop``): the loop's instructions that wait on a scoreboard, each with
the instruction that set it (the nearest before it, through the loop's back edge; ``write``: its
result, ``read``: its source registers, held until a memory instruction has read them), read
from the control bits of each instruction's second 64-bit word. Why an instruction stalls on
"long scoreboard" in ncu's source view is where this points (ragged v40, benchmarks/NOTES.md:
a ``wgmma`` fence waiting for a block-table load of the step before).

``--loop SUBSTRING``: for the first kernel whose mangled name contains it, the largest loop (a
backward branch) that holds tensor-core instructions (HMMA or HGMMA): its static instructions,
and the **common path** of the decode and few-row kernels' chunk loop: the loop less the
alternatives a chunk of full tiles does not take. Those are the blocks that a two-predicate
branch ``@P BRA Q, target`` jumps over (the checked fetch of a chunk that reaches a sequence's
end, or whose tiles cross pages) and a forward-branched block of 16 or more FMUL and no tensor or
copy instruction (the O rescale, taken only while a running max moves). The path is printed by
opcode. It is the count behind "The decode loop's common path by count" in benchmarks/NOTES.md;
a static count, not ncu's executed instructions (which a GPU run gives).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The build's device flags (CMakeLists.txt), for the one architecture counted.
NVCC_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-cubin", "--fmad=false", "--ftz=true",
              "-std=c++17", "-O3", "-DJAX_NVFP4_WITH_CUDA", "--diag-suppress=940,2473",
              "-Xptxas", "-v")
TENSOR_OPCODES = ("HMMA", "HGMMA")

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b(?:\s+!?U?P\w+,)?\s+(0x[0-9a-f]+)")
_TWO_PREDICATE_BRANCH = re.compile(r"^@!?P\w+\s+BRA\s+!?P\w+,\s+(0x[0-9a-f]+)")
_FORWARD_BRANCH = re.compile(r"^@!?P\w+\s+BRA\s+(0x[0-9a-f]+)")


def _kernel_listings(sass):
    """``(mangled name, its part of the listing)`` for each function of a ``cuobjdump -sass``
    listing."""
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        yield part.split("\n", 1)[0].strip(), part


def functions(sass):
    """``{mangled name: [(address, instruction text)]}`` of a ``cuobjdump -sass`` listing."""
    return {name: [(int(a, 16), t.strip()) for a, t in _INSTRUCTION.findall(part)]
            for name, part in _kernel_listings(sass)}


#: An instruction (as _INSTRUCTION) with its first encoding word and, on the next line, its
#: second, which holds the scheduling controls.
_ENCODED = re.compile(_INSTRUCTION.pattern +
                      r"\s*/\*\s*0x[0-9a-f]+\s*\*/\s*\n\s*/\*\s*(0x[0-9a-f]+)\s*\*/")
#: A scoreboard index of 7 in a control field means none.
_NO_SCOREBOARD = 7


def control(high):
    """The scheduling controls of an instruction (sm_70 and later) from its second 64-bit word,
    bits 41 and up: stall cycles, the yield bit, the scoreboard set when its result is written
    (``write``) and when its source registers have been read (``read``; None for none), and
    the scoreboards it waits for (``wait``, indices 0-5)."""
    c = high >> 41
    write, read = (c >> 5) & 7, (c >> 8) & 7
    return {"stall": c & 15, "yield": (c >> 4) & 1,
            "write": None if write == _NO_SCOREBOARD else write,
            "read": None if read == _NO_SCOREBOARD else read,
            "wait": [b for b in range(6) if (c >> 11) >> b & 1]}


def controls(sass):
    """``{mangled name: {address: control(...)}}`` of a ``cuobjdump -sass`` listing (its
    instructions with both encoding words)."""
    return {name: {int(a, 16): control(int(h, 16)) for a, _, h in _ENCODED.findall(part)}
            for name, part in _kernel_listings(sass)}


def scoreboard_waits(instructions, loop, bits):
    """The instructions of ``loop`` (a slice of a kernel's ``instructions``) that wait on a
    scoreboard: ``[(address, text, [(scoreboard, setter address, setter text, 'write' or
    'read')])]``, the setter the nearest instruction before that sets it, searched back through
    the loop and its back edge, then before the loop (None where nothing does). ``bits``: the
    kernel's :func:`controls`."""
    start = instructions.index(loop[0])
    before = instructions[:start]

    def setter(i, b):
        order = list(reversed(loop[:i])) + list(reversed(loop[i + 1:])) + list(reversed(before))
        for address, text in order:
            c = bits.get(address, {})
            for kind in ("write", "read"):
                if c.get(kind) == b:
                    return address, text, kind
        return None, None, None

    out = []
    for i, (address, text) in enumerate(loop):
        waits = bits.get(address, {}).get("wait", [])
        if waits:
            out.append((address, text, [(b, *setter(i, b)) for b in waits]))
    return out


def resources(ptxas_log):
    """``{mangled name: (registers, spill store bytes, spill load bytes, stack frame bytes)}``
    from ``ptxas -v``. The stack frame is apart from the spills: a local array indexed at run
    time lives there with 0 bytes of spills (ragged v26: q's held half row, 256 bytes of STL /
    LDL in the pipelined kernel's prologue)."""
    out = {}
    pattern = re.compile(r"Compiling entry function '(\S+)'.*?\n(.*?)"
                         r"ptxas info\s*: Used (\d+) registers", re.S)
    for m in pattern.finditer(ptxas_log):
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", m.group(2))
        stores, loads = (int(x) for x in spills.groups()) if spills else (0, 0)
        frame = re.search(r"(\d+) bytes stack frame", m.group(2))
        out[m.group(1)] = (int(m.group(3)), stores, loads, int(frame.group(1)) if frame else 0)
    return out


#: ptxas's note that it made every wgmma of a function wait for the one before (C7512, C7513,
#: ...): the tensor core's products then no longer overlap each other or the code around them.
_SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async "
                         r"instructions are serialized due to (.+?) (?:for|in) the function "
                         r"'(\S+)'")


def serialized_wgmma(ptxas_log):
    """``{mangled name: (code, reason)}`` of the kernels whose ``wgmma`` ptxas serialised, from
    its log (``-Xptxas -v`` prints the note). Ragged v34 (the wide kernel capped at 128
    registers) had it, "insufficient register resources", and ran ~22% slower a CTA at the same
    placement; a wait for a product under a branch in the loop gives "non wgmma instructions
    defining input registers of a wgmma between start and end of the pipeline stage". Count
    it before a GPU run: the static counts do not show it."""
    return {m.group(3): (m.group(1), m.group(2)) for m in _SERIALIZED.finditer(ptxas_log)}


_LIVE_TEXT = re.compile(r"^\.text\.(\S+?):")
_LIVE_LABEL = re.compile(r"^(\.L_\w+):")
_LIVE_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);\s*//\s*\|\s*(\d*)\s*\|")
_LIVE_TARGET = re.compile(r"`\((\.L_\w+)\)")


def live_registers(listing):
    """``{mangled name: [(address, instruction text, live general registers)]}`` of an
    ``nvdisasm --print-life-ranges --life-range-mode count`` listing. Branch targets (labels
    there) are written as addresses, as ``cuobjdump -sass`` gives them, so that
    :func:`largest_loop` reads both."""
    rows, labels, name, pending = {}, {}, None, []
    for line in listing.splitlines():
        if text := _LIVE_TEXT.match(line):
            name, pending = text.group(1), []
            rows[name], labels[name] = [], {}
        elif name is None:
            continue
        elif label := _LIVE_LABEL.match(line):
            pending.append(label.group(1))
        elif m := _LIVE_INSTRUCTION.search(line):
            address = int(m.group(1), 16)
            labels[name].update((label, address) for label in pending)
            pending = []
            rows[name].append((address, m.group(2).strip(), int(m.group(3) or 0)))

    def addressed(name, text):
        return _LIVE_TARGET.sub(lambda t: hex(labels[name].get(t.group(1), -1)), text)

    return {name: [(a, addressed(name, text), live) for a, text, live in body]
            for name, body in rows.items()}


def opcode(text):
    """The instruction's opcode without predicate and modifiers: ``@!P0 IMAD.WIDE.U32 ..`` ->
    ``IMAD``."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def largest_loop(instructions, markers=TENSOR_OPCODES, innermost=False):
    """The instructions from a backward branch's target to the branch, the largest such span
    that holds an instruction of ``markers`` (``innermost``: the smallest, e.g. the wide
    kernel's step loop where the largest spans its two step loops); None where there is none."""
    best = None
    for address, text in instructions:
        m = _BRANCH.search(text)
        if not m or int(m.group(1), 16) >= address:
            continue
        target = int(m.group(1), 16)
        body = [x for x in instructions if target <= x[0] <= address]
        if any(opcode(t) in markers for _, t in body) and (
                best is None or (len(body) < len(best) if innermost else len(body) > len(best))):
            best = body
    return best


def common_path(loop):
    """The loop's instructions less the checked alternatives and the O rescale (module
    docstring)."""
    skipped = set()
    for address, text in loop:
        m = _TWO_PREDICATE_BRANCH.search(text)
        if m:
            skipped.update(a for a, _ in loop if address < a < int(m.group(1), 16))
    for address, text in loop:
        m = _FORWARD_BRANCH.search(text)
        if not m or int(m.group(1), 16) <= address:
            continue
        block = [(a, t) for a, t in loop if address < a < int(m.group(1), 16)]
        ops = [opcode(t) for _, t in block]
        if ops.count("FMUL") >= 16 and not any(o in TENSOR_OPCODES or o == "LDGSTS"
                                               for o in ops):
            skipped.update(a for a, _ in block)
    return [(a, t) for a, t in loop if a not in skipped]


def histogram(instructions, most=30):
    counts = collections.Counter(opcode(t) for _, t in instructions)
    return " ".join(f"{k}:{v}" for k, v in counts.most_common(most))


def _tool(name):
    """A CUDA tool from PATH, else from pip's nvidia-* packages."""
    found = shutil.which(name)
    if found:
        return found
    for path in sys.path:
        hits = glob.glob(os.path.join(path, "nvidia", "*", "bin", name))
        if hits:
            return hits[0]
    raise SystemExit(f"{name} not found: put the CUDA toolkit on PATH (cuobjdump also comes "
                     f"with `pip install nvidia-cuda-cuobjdump`)")


def ffi_include():
    """The XLA FFI headers' folder (the build's ffi/find_xla_ffi_include.py)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "ffi", "find_xla_ffi_include.py")],
                          capture_output=True, text=True, check=True).stdout.strip()


def _compile(tree, source, defines, cubin):
    """Compiles ``tree/source`` with NVCC_FLAGS into ``cubin``; returns ptxas's log."""
    cmd = [_tool("nvcc"), *NVCC_FLAGS, f"-I{ffi_include()}", f"-I{os.path.join(tree, 'ffi')}",
           *(f"-D{d}" for d in defines), "-o", cubin, os.path.join(tree, source)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stderr


def ptxas_log(tree, source, defines=()):
    """ptxas's log (``-v``) of ``tree/source`` compiled with NVCC_FLAGS (nvcc only)."""
    with tempfile.TemporaryDirectory() as work:
        return _compile(tree, source, defines, os.path.join(work, "out.cubin"))


def compile_sass(tree, source, defines=(), live=False):
    """(disassembly, ptxas log) of ``tree/source`` compiled with NVCC_FLAGS; with ``live``, a
    third item from the same cubin: ``nvdisasm --print-life-ranges --life-range-mode count``
    (for :func:`live_registers`)."""
    with tempfile.TemporaryDirectory() as work:
        cubin = os.path.join(work, "out.cubin")
        log = _compile(tree, source, defines, cubin)

        def listing(*cmd):
            return subprocess.run([*cmd, cubin], capture_output=True, text=True,
                                  check=True).stdout

        sass = listing(_tool("cuobjdump"), "-sass")
        if not live:
            return sass, log
        return sass, log, listing(_tool("nvdisasm"), "-plr", "-lrm", "count")


def patched_tree(patch, work):
    """A copy of the repository's ffi/ with ``patch`` applied, in ``work``."""
    shutil.copytree(os.path.join(ROOT, "ffi"), os.path.join(work, "ffi"))
    subprocess.run(["git", "apply", "--include=ffi/*", os.path.abspath(patch)], cwd=work,
                   check=True)
    return work


def report(sass, ptxas_log, loop=None, out=sys.stdout, live=None, innermost=False,
           scoreboards=False):
    """Prints every kernel's resources and size, and ``loop``'s counts; returns the common
    path's length (None without ``loop``). ``live``: :func:`live_registers` of the same code,
    whose peaks are printed too; ``innermost``: the smallest such loop (:func:`largest_loop`);
    ``scoreboards``: the loop's scoreboard waits and their setters (:func:`scoreboard_waits`)."""
    kernels = functions(sass)
    live = live or {}
    used = resources(ptxas_log)
    serialized = serialized_wgmma(ptxas_log)
    for name, instructions in kernels.items():
        regs, stores, loads, frame = used.get(name, (None, None, None, None))
        spill = f", spills {stores} / {loads} B" if stores or loads else ""
        stack = f", stack frame {frame} B" if frame else ""
        waits = (f", WGMMA SERIALIZED ({serialized[name][0]}: {serialized[name][1]})"
                 if name in serialized else "")
        peak = (f", at most {max(r[2] for r in live[name])} live" if live.get(name) else "")
        print(f"{len(instructions):6d} instructions, {regs} registers{spill}{stack}{waits}{peak}: "
              f"{name}", file=out)
    if not loop:
        return None
    matches = [n for n in kernels if loop in n]
    if not matches:
        raise SystemExit(f"no kernel's name contains {loop!r}")
    body = largest_loop(kernels[matches[0]], innermost=innermost)
    if body is None:
        raise SystemExit(f"{matches[0]}: no loop with {' or '.join(TENSOR_OPCODES)}")
    path = common_path(body)
    print(f"\n{matches[0]}\n  loop 0x{body[0][0]:x}-0x{body[-1][0]:x}: {len(body)} static, "
          f"common path {len(path)}\n  {histogram(path)}", file=out)
    rows = [r for r in live.get(matches[0], []) if body[0][0] <= r[0] <= body[-1][0]]
    if rows:
        address, text, most = max(rows, key=lambda r: r[2])
        print(f"  live registers in the loop: at most {most}, first at 0x{address:x} ({text})",
              file=out)
    if scoreboards:
        bits = controls(sass).get(matches[0], {})
        if not bits:
            raise SystemExit("--scoreboards: the listing has no second encoding words "
                             "(cuobjdump -sass prints them)")
        print("  scoreboard waits in the loop (scoreboard: set by):", file=out)
        for address, text, waits in scoreboard_waits(kernels[matches[0]], body, bits):
            by = "; ".join(f"SB{b}: " + (f"0x{a:x} {t} ({kind})" if a is not None else "nothing")
                           for b, a, t, kind in waits)
            print(f"    0x{address:05x}  {text:48s}  {by}", file=out)
    return len(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", help="a file of ffi/, e.g. ffi/decode_cuda.cu")
    p.add_argument("--loop", help="count this kernel's chunk loop (a substring of its name)")
    p.add_argument("--patch", help="compile with this patch applied to a copy of ffi/")
    p.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                   help="a preprocessor definition (a build option)")
    p.add_argument("--innermost", action="store_true",
                   help="with --loop: the smallest loop with tensor-core instructions, not the "
                        "largest (the wide kernel's step loop)")
    p.add_argument("--live", action="store_true",
                   help="also the live registers (nvdisasm --print-life-ranges; needs nvdisasm)")
    p.add_argument("--scoreboards", action="store_true",
                   help="with --loop: the loop's scoreboard waits and what set each")
    p.add_argument("--sass", help="a saved cuobjdump -sass listing instead of compiling")
    p.add_argument("--ptxas", help="with --sass: the ptxas -v log that goes with it")
    args = p.parse_args(argv)
    if args.sass:
        with open(args.sass) as f:
            sass = f.read()
        ptxas_log = open(args.ptxas).read() if args.ptxas else ""
        return report(sass, ptxas_log, args.loop, innermost=args.innermost,
                      scoreboards=args.scoreboards)
    if not args.source:
        p.error("a source file (or --sass) is needed")
    with tempfile.TemporaryDirectory() as work:
        tree = patched_tree(args.patch, work) if args.patch else ROOT
        sass, log, *life = compile_sass(tree, args.source, args.defines, live=args.live)
    return report(sass, log, args.loop, live=live_registers(life[0]) if life else None,
                  innermost=args.innermost, scoreboards=args.scoreboards)


if __name__ == "__main__":
    main()
