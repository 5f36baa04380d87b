"""benchmarks/sass_counts.py's reading of a disassembly and of ptxas's log, on a synthetic
listing shaped like cuobjdump's (no nvcc needed): the kernels, their resources, the largest
loop with tensor-core instructions and its common path (less the checked alternative a
two-predicate branch jumps over and the O rescale block)."""

import io

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
