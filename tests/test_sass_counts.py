"""benchmarks/sass_counts.py's reading of a disassembly and of ptxas's log, on a synthetic
listing shaped like cuobjdump's (no nvcc needed): the kernels, their resources, the largest
loop with tensor-core instructions and its common path (less the checked alternative a
two-predicate branch jumps over and the O rescale block), ptxas's note of serialised wgmma; and,
where nvcc is on PATH (CI has it), that no shipped wgmma kernel carries that note."""

import io
import shutil

import pytest

from scripts import load_script

sc = load_script("benchmarks/sass_counts.py", "sass_counts_under_test")


def _listing(name, body):
    lines = ["", "\tcode for sm_90a", f"\t\tFunction : {name}",
             "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    for i, text in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;"
                     f"                 /* 0x000fe20000000f00 */")
    return "\n".join(lines) + "\n"


def _loop_kernel():
    """A loop from 0x10: 2 HMMA, a checked alternative of 3 instructions that a two-predicate
    branch jumps over to the full path, a rescale block of 16 FMUL that a forward branch jumps
    over, then the backward branch."""
    body = ["MOV R1, c[0x0][0x28]",                                   # before the loop
            "LDS.128 R4, [R2]", "HMMA.16816.F32 R8, R4, R12, R8",     # 0x10: the loop
            "@!P1 BRA P4, FULL",
            "IMAD R3, R3, 0x4, RZ", "LDGSTS.E [R5], desc[UR4][R6.64]", "BRA JOIN",  # checked
            "LDGSTS.E [R5+0x10], desc[UR4][R6.64]",                  # FULL: the full path
            "@!P0 BRA AFTER"] + ["FMUL.FTZ R20, R20, R21"] * 16 + [  # JOIN: the rescale
            "HMMA.16816.F32 R8, R4, R12, R8",                        # AFTER
            "@!P2 BRA 0x10", "EXIT"]
    at = {"FULL": 7, "JOIN": 8, "AFTER": 8 + 1 + 16}
    for name, index in at.items():
        body = [t.replace(name, f"0x{16 * index:x}") if t.endswith(name) else t for t in body]
    return body


def test_functions_resources_and_the_common_path():
    body = _loop_kernel()
    sass = _listing("_Z4loopv", body) + _listing("_Z5otherv", ["MOV R1, R2", "EXIT"])
    log = ("ptxas info    : Compiling entry function '_Z4loopv' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z4loopv\n"
           "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers\n"
           "ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z5otherv\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 8 registers\n")
    kernels = sc.functions(sass)
    assert list(kernels) == ["_Z4loopv", "_Z5otherv"] and len(kernels["_Z4loopv"]) == len(body)
    assert sc.resources(log) == {"_Z4loopv": (128, 8, 12, 16), "_Z5otherv": (8, 0, 0, 0)}
    loop = sc.largest_loop(kernels["_Z4loopv"])
    assert loop[0][0] == 0x10 and loop[-1][1] == "@!P2 BRA 0x10"
    path = sc.common_path(loop)
    # the loop less the checked alternative (3) and the rescale block (16)
    assert len(path) == len(loop) - 3 - 16
    ops = [sc.opcode(t) for _, t in path]
    assert ops.count("HMMA") == 2 and ops.count("LDGSTS") == 1 and "FMUL" not in ops
    assert sc.largest_loop(kernels["_Z5otherv"]) is None
    out = io.StringIO()
    assert sc.report(sass, log, "loopv", out=out) == len(path)
    text = out.getvalue()
    assert "128 registers, spills 8 / 12 B, stack frame 16 B: _Z4loopv" in text, text
    assert "8 registers: _Z5otherv" in text
    assert f"common path {len(path)}" in text and "HMMA:2" in text


def test_opcode_drops_predicates_and_modifiers():
    assert sc.opcode("@!P0 IMAD.WIDE.U32 R4, R5, UR6, R8") == "IMAD"
    assert sc.opcode("@UP1 LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]") == "LDGSTS"
    assert sc.opcode("HGMMA.64x64x16.F32 R24, gdesc[UR4], R24") == "HGMMA"


def test_serialized_wgmma_read_from_the_log():
    """ptxas's two notes seen on the wide kernel (ragged v34 and v36, benchmarks/NOTES.md), one
    kernel each; a kernel without a note is not listed."""
    log = ("ptxas info    : Compiling entry function '_Z4widev' for 'sm_90a'\n"
           "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to insufficient register resources for the function '_Z4widev'\n"
           "ptxas info    : Used 128 registers\n"
           "ptxas info    : Compiling entry function '_Z5stepsv' for 'sm_90a'\n"
           "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to non wgmma instructions defining input registers of a wgmma "
           "between start and end of the pipeline stage in the function '_Z5stepsv'\n"
           "ptxas info    : Used 154 registers\n"
           "ptxas info    : Compiling entry function '_Z4finev' for 'sm_90a'\n"
           "ptxas info    : Used 168 registers\n")
    assert sc.serialized_wgmma(log) == {
        "_Z4widev": ("C7512", "insufficient register resources"),
        "_Z5stepsv": ("C7513", "non wgmma instructions defining input registers of a wgmma "
                               "between start and end of the pipeline stage")}
    sass = "".join(_listing(name, ["HGMMA.64x32x16.F32 R24, R8, gdesc[UR4], R24", "EXIT"])
                   for name in ("_Z4widev", "_Z4finev"))
    out = io.StringIO()
    sc.report(sass, log, out=out)
    lines = out.getvalue().splitlines()
    assert "WGMMA SERIALIZED (C7512: insufficient register resources): _Z4widev" in lines[0]
    assert "SERIALIZED" not in lines[1] and lines[1].endswith("168 registers: _Z4finev")


_NVCC = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit)")


@_NVCC
@pytest.mark.parametrize("source", ["ffi/ragged_cuda.cu", "ffi/ragged_pipelined.cu",
                                    "ffi/ragged_few_rows.cu"])
def test_shipped_wgmma_kernels_are_not_serialized(source):
    """No kernel of the files with wgmma (sm_90a, the build's flags) has ptxas's serialisation
    note: it makes every product wait for the one before, a silent slowdown (ragged v34: ~22%
    a CTA) that no CPU test and no correctness test on a GPU would see."""
    log = sc.ptxas_log(str(sc.ROOT), source)
    assert "Compiling entry function" in log  # ptxas -v ran and logged
    assert sc.serialized_wgmma(log) == {}, sc.serialized_wgmma(log)


@_NVCC
def test_the_serialisation_check_sees_a_serialised_kernel():
    """The check above can fail: the wide kernel built for five CTAs a SM is serialised (four
    were too until ragged v45, ragged v34; since v45 four spill without it), and the note is
    read from this nvcc's log. (If nvcc words it otherwise one day, this fails instead of the
    check going blind.)"""
    log = sc.ptxas_log(str(sc.ROOT), "ffi/ragged_few_rows.cu", ["NVFP4_WIDE_MIN_CTAS=5"])
    serialized = sc.serialized_wgmma(log)
    assert serialized and all("WideRowsKernel" in name for name in serialized), serialized


def _live_listing():
    """nvdisasm --print-life-ranges --life-range-mode count's shape: a text section per kernel,
    labels as branch targets, the live count in the first trailing column."""
    def row(address, text, live):
        return (f"        /*{address:04x}*/                   {text} ;"
                f"                                   // |  {live:3d}  |   1    |        |")
    return "\n".join([
        "\t.section\t.text._Z4loopv,\"ax\",@progbits",
        ".text._Z4loopv:                                     // |       |        |        |",
        row(0x0, "MOV R1, c[0x0][0x28]", 2),
        ".L_x_0:",
        row(0x10, "LDS.128 R4, [R2]", 7),
        row(0x20, "HMMA.16816.F32 R8, R4, R12, R8", 21),
        row(0x30, "@!P2 BRA `(.L_x_0)", 12),
        row(0x40, "EXIT", 0),
        "\t.section\t.text._Z5otherv,\"ax\",@progbits",
        ".text._Z5otherv:                                    // |       |        |        |",
        ".L_x_0:",
        row(0x0, "MOV R1, R2", 30),
        row(0x10, "BRA `(.L_x_0)", 1),
    ]) + "\n"


def test_live_registers_and_the_loop_peak():
    live = sc.live_registers(_live_listing())
    assert list(live) == ["_Z4loopv", "_Z5otherv"]
    # labels become the addresses they stand for, per kernel (both kernels have .L_x_0)
    assert live["_Z4loopv"][3] == (0x30, "@!P2 BRA 0x10", 12)
    assert live["_Z5otherv"][1] == (0x10, "BRA 0x0", 1)
    loop = sc.largest_loop([(a, t) for a, t, _ in live["_Z4loopv"]])
    assert [a for a, _ in loop] == [0x10, 0x20, 0x30]
    sass = _listing("_Z4loopv", ["MOV R1, c[0x0][0x28]", "LDS.128 R4, [R2]",
                                 "HMMA.16816.F32 R8, R4, R12, R8", "@!P2 BRA 0x10", "EXIT"])
    out = io.StringIO()
    sc.report(sass, "", "loopv", out=out, live=live)
    text = out.getvalue()
    assert "at most 21 live: _Z4loopv" in text, text
    assert ("live registers in the loop: at most 21, first at 0x20 "
            "(HMMA.16816.F32 R8, R4, R12, R8)") in text, text


def test_innermost_picks_the_smallest_tensor_loop():
    """Two loops with tensor-core instructions, one inside the other (the wide kernel's step
    loops inside its outer span): the largest by default, the inner one with ``innermost``;
    a loop without them is never chosen."""
    body = ["MOV R1, R2",                                            # 0x00
            "HGMMA.64x32x16.F32 R24, R8, gdesc[UR4], R24",          # 0x10: outer from here
            "HGMMA.64x32x16.F32 R24, R8, gdesc[UR4], R24",          # 0x20: inner from here
            "IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x20",                # 0x30, 0x40: inner's end
            "IADD3 R2, R2, 0x1, RZ", "@P1 BRA 0x50",                # 0x50, 0x60: no tensor op
            "@P2 BRA 0x10", "EXIT"]                                  # 0x70: outer's end
    kernels = sc.functions(_listing("_Z4nestv", body))
    outer = sc.largest_loop(kernels["_Z4nestv"])
    inner = sc.largest_loop(kernels["_Z4nestv"], innermost=True)
    assert (outer[0][0], outer[-1][0]) == (0x10, 0x70)
    assert (inner[0][0], inner[-1][0]) == (0x20, 0x40)
    out = io.StringIO()
    assert sc.report(_listing("_Z4nestv", body), "", "nestv", out=out, innermost=True) == 3
    assert "loop 0x20-0x40: 3 static" in out.getvalue(), out.getvalue()


def _encoded_listing(name, body):
    """Like _listing, each instruction with its second encoding word (cuobjdump's next line):
    body is [(text, high word)]."""
    lines = ["", "\tcode for sm_90a", f"\t\tFunction : {name}",
             "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    for i, (text, high) in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;"
                     f"                 /* 0x000fe20000000f00 */")
        lines.append(f"                                                   /* 0x{high:016x} */")
    return "\n".join(lines) + "\n"


def _high(stall=1, write=7, read=7, wait=()):
    """A second encoding word with these controls (bits 41 and up: stall 4, yield 1, write
    scoreboard 3, read scoreboard 3, wait mask 6)."""
    return (stall | write << 5 | read << 8 | sum(1 << b for b in wait) << 11) << 41


def test_control_bits_of_real_instructions():
    # From WideRowsKernel<true, kHND>'s disassembly (sm_90a, ragged v40): the block-table load
    # sets scoreboard 5 on its result and 1 on its sources; the branch waits on 5.
    ldg = sc.control(0x000368000C1E9900)
    assert (ldg["stall"], ldg["yield"], ldg["write"], ldg["read"], ldg["wait"]) == (4, 1, 5, 1, [])
    bra = sc.control(0x020FEC0003800000)
    assert (bra["stall"], bra["write"], bra["read"], bra["wait"]) == (6, None, None, [5])


def test_scoreboard_waits_find_their_setters_through_the_back_edge():
    body = [("LDG.E R20, desc[UR4][R2.64]", _high(write=3)),           # before the loop
            ("@!P0 BRA 0x60", _high(wait=[5])),                         # 0x10: the loop
            ("HMMA.16816.F32 R8, R4, R12, R8", _high()),
            ("IADD3 R21, R20, 0x1, RZ", _high(wait=[3])),               # the load before the loop
            ("LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64]", _high(read=1)),
            ("IMAD.MOV.U32 R6, RZ, RZ, R7", _high(wait=[1, 2])),        # its sources; 2: nothing
            ("LDG.E.CONSTANT R9, desc[UR4][R10.64]", _high(write=5)),   # 0x60
            ("@!P1 BRA 0x10", _high()),
            ("EXIT", _high())]
    sass = _encoded_listing("_Z4loopv", body)
    kernels, bits = sc.functions(sass), sc.controls(sass)
    assert bits["_Z4loopv"][0x10]["wait"] == [5] and bits["_Z4loopv"][0x40]["read"] == 1
    loop = sc.largest_loop(kernels["_Z4loopv"])
    waits = sc.scoreboard_waits(kernels["_Z4loopv"], loop, bits["_Z4loopv"])
    assert [(a, [(b, at, kind) for b, at, _, kind in w]) for a, _, w in waits] == [
        (0x10, [(5, 0x60, "write")]),         # through the back edge
        (0x30, [(3, 0x00, "write")]),         # before the loop
        (0x50, [(1, 0x40, "read"), (2, None, None)])]
    out = io.StringIO()
    sc.report(sass, "", loop="loop", out=out, scoreboards=True)
    assert "SB5: 0x60 LDG.E.CONSTANT R9" in out.getvalue() and "SB2: nothing" in out.getvalue()
    with pytest.raises(SystemExit, match="second encoding words"):
        sc.report(_listing("_Z4loopv", [t for t, _ in body]), "", loop="loop",
                  out=io.StringIO(), scoreboards=True)
