"""The HLO readers of tests/hlo_checks.py on hand-written modules (in the format of
``jax.jit(...).lower(...).compile().as_text()``): what they report as a copy of the cache, a
collective, a store and an alias, and what they must not (XLA:GPU's dynamic-slice fusion of the
store)."""

from __future__ import annotations

import pytest

import hlo_checks as hc

CACHE = (3, 2, 2, 4, 36)
U8 = "u8[3,2,2,4,36]{4,3,2,1,0}"
HEADER = ("HloModule jit_reshape_and_cache, is_scheduled=true, "
          "input_output_alias={ {}: (2, {}, may-alias) }, entry_computation_layout={(bf16[4,2,64]"
          "{2,1,0}, bf16[4,2,64]{2,1,0}, u8[3,2,2,4,36]{4,3,2,1,0}, s32[4]{0}, f32[], "
          "/*index=5*/f32[])->u8[3,2,2,4,36]{4,3,2,1,0}}")
STORE = ('custom_call_target="jax_nvfp4_reshape_and_cache", '
         "output_to_operand_aliasing={{}: (2, {})}, api_version=API_VERSION_TYPED_FFI")
PARAMS = f"""
  %key.1 = bf16[4,2,64]{{2,1,0}} parameter(0), metadata={{op_name="key"}}
  %value.1 = bf16[4,2,64]{{2,1,0}} parameter(1), metadata={{op_name="value"}}
  %kv_cache.1 = {U8} parameter(2), metadata={{op_name="kv_cache"}}
  %slot_mapping.1 = s32[4]{{0}} parameter(3)
  %k_scale.1 = f32[] parameter(4)
  %v_scale.1 = f32[] parameter(5)"""
ENTRY = ("ENTRY %main.1 (key.1: bf16[4,2,64], value.1: bf16[4,2,64], kv_cache.1: u8[3,2,2,4,36], "
         "slot_mapping.1: s32[4], k_scale.1: f32[], v_scale.1: f32[]) -> u8[3,2,2,4,36] {")


def module(body, *, header=HEADER, computations=""):
    """A module: ``computations``, then an ENTRY with the store's parameters and ``body``,
    whose ``%cache`` operand names the array the store writes (ROOT)."""
    return f"""{header}

FileNames
1 "/tmp/example.py"

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
{computations}
{ENTRY}{PARAMS}
{body}
}}

"""


def store(operand="%kv_cache.1"):
    return (f"  ROOT %nvfp4_reshape_and_cache_local.1 = {U8} custom-call(%key.1, %value.1, "
            f"{operand}, %slot_mapping.1, %k_scale.1, /*index=5*/%v_scale.1), {STORE}")


PLAIN = module(store())


def test_plain_store_is_in_place():
    assert hc.cache_copies(PLAIN) == []
    assert hc.cache_copies(PLAIN, [CACHE]) == []
    assert hc.collectives(PLAIN) == []
    (call,) = hc.store_calls(PLAIN)
    assert call.opcode == "custom-call" and call.is_root and call.computation == "main.1"
    assert call.u8_arrays == [CACHE] and hc.is_aliased(call)
    assert hc.store_computations(PLAIN) == {"main.1"}
    assert hc.input_output_aliases(PLAIN) == {(): (2, ())}
    hc.assert_in_place(PLAIN, CACHE)
    hc.assert_in_place(PLAIN, CACHE, cache_shapes=[CACHE])


def test_assert_in_place_checks_store_shape_count_and_aliases():
    with pytest.raises(AssertionError):
        hc.assert_in_place(PLAIN, (3, 2, 2, 4, 37))            # another shape
    with pytest.raises(AssertionError):
        hc.assert_in_place(PLAIN, CACHE, num_stores=2)
    with pytest.raises(AssertionError):
        hc.assert_in_place(PLAIN, CACHE, aliases={(): 0})     # another parameter
    with pytest.raises(AssertionError):                        # not donated
        hc.assert_in_place(module(store(), header=HEADER.replace(
            "input_output_alias={ {}: (2, {}, may-alias) }, ", "")), CACHE)
    unaliased = PLAIN.replace(", output_to_operand_aliasing={{}: (2, {})}", "")
    assert not hc.is_aliased(hc.store_calls(unaliased)[0])
    with pytest.raises(AssertionError):
        hc.assert_in_place(unaliased, CACHE)
    other = PLAIN.replace('"jax_nvfp4_reshape_and_cache"', '"something_else"')
    assert hc.store_calls(other) == []
    with pytest.raises(AssertionError):
        hc.assert_in_place(other, CACHE)


def test_copy_of_the_cache_is_reported():
    text = module(f"  %copy.2 = {U8} copy(%kv_cache.1)\n" + store("%copy.2"))
    for shapes in (None, [CACHE]):
        (copy,) = hc.cache_copies(text, shapes)
        assert (copy.name, copy.opcode, copy.u8_arrays) == ("copy.2", "copy", [CACHE])
    with pytest.raises(AssertionError, match="copy.2"):
        hc.assert_in_place(text, CACHE)
    with pytest.raises(AssertionError, match="copy.2"):
        hc.assert_in_place(text, CACHE, cache_shapes=[CACHE])


def test_copy_start_and_copy_done_are_reported():
    text = module(f"  %copy-start = ({U8}, {U8}, u32[]) copy-start(%kv_cache.1)\n"
                  f"  %copy-done = {U8} copy-done(%copy-start)\n" + store("%copy-done"))
    for shapes in (None, [CACHE]):
        assert [i.opcode for i in hc.cache_copies(text, shapes)] == ["copy-start", "copy-done"]
    with pytest.raises(AssertionError):
        hc.assert_in_place(text, CACHE)


ADD_FUSION = f"""
%fused_add (param_0: u8[3,2,2,4,36], param_1: u8[]) -> u8[3,2,2,4,36] {{
  %param_0 = {U8} parameter(0)
  %param_1 = u8[] parameter(1)
  %broadcast.1 = {U8} broadcast(%param_1), dimensions={{}}
  ROOT %add.1 = {U8} add(%param_0, %broadcast.1)
}}
"""


def test_elementwise_fusion_writing_the_cache_shape_is_reported():
    text = module("  %constant.1 = u8[] constant(0)\n"
                  f"  %add_fusion = {U8} fusion(%kv_cache.1, %constant.1), kind=kLoop, "
                  "calls=%fused_add\n" + store("%add_fusion"), computations=ADD_FUSION)
    # The fusion, and the ops of its computation.
    reported = [(i.computation, i.name, i.opcode) for i in hc.cache_copies(text)]
    assert reported == [("fused_add", "broadcast.1", "broadcast"), ("fused_add", "add.1", "add"),
                        ("main.1", "add_fusion", "fusion")]
    assert hc.cache_copies(text, [CACHE]) == hc.cache_copies(text)
    assert hc.store_computations(text) == {"main.1"}
    with pytest.raises(AssertionError, match="add_fusion"):
        hc.assert_in_place(text, CACHE)


# XLA:GPU, the store in lax.scan over layers: key/value are dynamic slices of the stacked
# inputs, and the custom call is wrapped in a dynamic-slice fusion (kind=kCustom) whose ROOT is
# the store, still aliasing the cache (a parameter of the fused computation).
POOL = "u8[1,24,2,4,16,72]{5,4,3,2,1,0}"
SCAN_HEADER = ("HloModule jit_step, is_scheduled=true, input_output_alias={ {}: (2, {}, "
               "may-alias) }, entry_computation_layout={(bf16[3,24,4,128]{3,2,1,0}, "
               "bf16[3,24,4,128]{3,2,1,0}, u8[1,24,2,4,16,72]{5,4,3,2,1,0}, s32[3,24]{1,0}, "
               "f32[], /*index=5*/f32[])->u8[1,24,2,4,16,72]{5,4,3,2,1,0}}")


def scan_module(root_of_fused=None):
    fused_root = root_of_fused or (
        f"  ROOT %custom-call.3 = {POOL} custom-call(%bitcast.10, %bitcast.11, %p2, %p3, %p4, "
        f"%p5), {STORE}")
    return f"""{SCAN_HEADER}

%dynamic-slice-fusion (p0: bf16[3,24,4,128], p1: bf16[3,24,4,128], p2: u8[1,24,2,4,16,72], p3: s32[24], p4: f32[], p5: f32[], p6: s32[]) -> u8[1,24,2,4,16,72] {{
  %p0 = bf16[3,24,4,128]{{3,2,1,0}} parameter(0)
  %p1 = bf16[3,24,4,128]{{3,2,1,0}} parameter(1)
  %p2 = {POOL} parameter(2)
  %p3 = s32[24]{{0}} parameter(3)
  %p4 = f32[] parameter(4)
  %p5 = f32[] parameter(5)
  %p6 = s32[] parameter(6)
  %c0 = s32[] constant(0)
  %ds.0 = bf16[1,24,4,128]{{3,2,1,0}} dynamic-slice(%p0, %p6, %c0, %c0, %c0), dynamic_slice_sizes={{1,24,4,128}}
  %ds.1 = bf16[1,24,4,128]{{3,2,1,0}} dynamic-slice(%p1, %p6, %c0, %c0, %c0), dynamic_slice_sizes={{1,24,4,128}}
  %bitcast.10 = bf16[24,4,128]{{2,1,0}} bitcast(%ds.0)
  %bitcast.11 = bf16[24,4,128]{{2,1,0}} bitcast(%ds.1)
{fused_root}
}}

%body (carry: (s32[], {POOL}, bf16[3,24,4,128], bf16[3,24,4,128], s32[24], f32[], f32[])) -> (s32[], {POOL}, bf16[3,24,4,128], bf16[3,24,4,128], s32[24], f32[], f32[]) {{
  %carry = (s32[], {POOL}, bf16[3,24,4,128]{{3,2,1,0}}, bf16[3,24,4,128]{{3,2,1,0}}, s32[24]{{0}}, f32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %pool = {POOL} get-tuple-element(%carry), index=1
  %k = bf16[3,24,4,128]{{3,2,1,0}} get-tuple-element(%carry), index=2
  %v = bf16[3,24,4,128]{{3,2,1,0}} get-tuple-element(%carry), index=3
  %s = s32[24]{{0}} get-tuple-element(%carry), index=4
  %a = f32[] get-tuple-element(%carry), index=5
  %b = f32[] get-tuple-element(%carry), index=6
  %dynamic_slice_fusion = {POOL} fusion(%k, %v, %pool, %s, %a, /*index=5*/%b, %i), kind=kCustom, calls=%dynamic-slice-fusion, backend_config={{"fusion_backend_config":{{"kind":"__custom_fusion","custom_fusion_config":{{"name":"dynamic_address_computation"}}}}}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %tuple.1 = (s32[], {POOL}, bf16[3,24,4,128]{{3,2,1,0}}, bf16[3,24,4,128]{{3,2,1,0}}, s32[24]{{0}}, f32[], f32[]) tuple(%next, %dynamic_slice_fusion, %k, %v, %s, %a, %b)
}}

%cond (carry.1: (s32[], {POOL}, bf16[3,24,4,128], bf16[3,24,4,128], s32[24], f32[], f32[])) -> pred[] {{
  %carry.1 = (s32[], {POOL}, bf16[3,24,4,128]{{3,2,1,0}}, bf16[3,24,4,128]{{3,2,1,0}}, s32[24]{{0}}, f32[], f32[]) parameter(0)
  %j = s32[] get-tuple-element(%carry.1), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}}

ENTRY %main.2 (key: bf16[3,24,4,128], value: bf16[3,24,4,128], cache: u8[1,24,2,4,16,72], slots: s32[24], ks: f32[], vs: f32[]) -> u8[1,24,2,4,16,72] {{
  %key = bf16[3,24,4,128]{{3,2,1,0}} parameter(0), sharding={{replicated}}
  %value = bf16[3,24,4,128]{{3,2,1,0}} parameter(1)
  %cache = {POOL} parameter(2), sharding={{devices=[2,1,1,1,1,1]<=[2]}}
  %slots = s32[24]{{0}} parameter(3)
  %ks = f32[] parameter(4)
  %vs = f32[] parameter(5)
  %zero = s32[] constant(0)
  %init = (s32[], {POOL}, bf16[3,24,4,128]{{3,2,1,0}}, bf16[3,24,4,128]{{3,2,1,0}}, s32[24]{{0}}, f32[], f32[]) tuple(%zero, %cache, %key, %value, %slots, %ks, %vs)
  %while = (s32[], {POOL}, bf16[3,24,4,128]{{3,2,1,0}}, bf16[3,24,4,128]{{3,2,1,0}}, s32[24]{{0}}, f32[], f32[]) while(%init), condition=%cond, body=%body
  ROOT %out = {POOL} get-tuple-element(%while), index=1
}}
"""


def test_dynamic_slice_fusion_of_the_store_is_in_place():
    text = scan_module()
    assert hc.store_computations(text) == {"dynamic-slice-fusion"}
    fusion = [i for i in hc.instructions(text) if i.opcode == "fusion"]
    assert [f.calls for f in fusion] == [("dynamic-slice-fusion",)]
    assert hc.cache_copies(text) == []
    assert hc.cache_copies(text, [(1, 24, 2, 4, 16, 72), (2, 24, 2, 4, 16, 72)]) == []
    (call,) = hc.store_calls(text)
    assert call.computation == "dynamic-slice-fusion" and hc.is_aliased(call)
    hc.assert_in_place(text, (1, 24, 2, 4, 16, 72))


def test_fusion_whose_root_is_not_the_store_is_reported():
    """The same fusion with another ROOT: a copy (what test_sharding.py reported before it
    knew the store's fusion: [('fusion', 'u8[1,24,2,4,16,72]{5,4,3,2,1,0}')])."""
    text = scan_module(f"  ROOT %add.7 = {POOL} add(%p2, %p2)")
    assert hc.store_computations(text) == set()
    assert [(i.name, i.opcode) for i in hc.cache_copies(text)] == [
        ("add.7", "add"), ("dynamic_slice_fusion", "fusion")]
    with pytest.raises(AssertionError, match="dynamic_slice_fusion"):
        hc.assert_in_place(text, (1, 24, 2, 4, 16, 72))


@pytest.mark.parametrize("op", ["all-gather", "all-reduce", "all-to-all", "reduce-scatter",
                                "collective-permute", "all-gather-start", "all-reduce-done"])
def test_collectives_are_reported(op):
    text = module(f"  %{op}.1 = u8[6,2,2,4,36]{{4,3,2,1,0}} {op}(%kv_cache.1), "
                  "channel_id=1, replica_groups=[1,2]<=[2], dimensions={0}\n" + store())
    assert hc.collectives(text) == [op]
    with pytest.raises(AssertionError, match=op):
        hc.assert_in_place(text, CACHE, cache_shapes=[CACHE])
    # The gathered array is no cache (6 blocks): not a copy by size, but by rank.
    assert hc.cache_copies(text, [CACHE]) == []
    assert [i.opcode for i in hc.cache_copies(text)] == [op]


def test_copy_by_size_and_by_rank():
    """By size (``cache_shapes``): a copy of the cache's bytes of any rank, not a rank-5 array
    of other bytes (a page gather); by rank: the other way round."""
    text = module("  %bitcast.1 = u8[12,144]{1,0} bitcast(%kv_cache.1)\n"
                  "  %copy.3 = u8[12,144]{1,0} copy(%bitcast.1)\n"
                  "  %gather.1 = u8[5,2,2,4,36]{4,3,2,1,0} gather(%kv_cache.1, %slot_mapping.1), "
                  "offset_dims={1,2,3,4}, collapsed_slice_dims={0}, start_index_map={0}, "
                  "index_vector_dim=1, slice_sizes={1,2,2,4,36}\n" + store())
    assert [i.name for i in hc.cache_copies(text, [CACHE])] == ["copy.3"]
    assert [i.name for i in hc.cache_copies(text)] == ["gather.1"]
    assert [i.name for i in hc.cache_copies(text, [CACHE, (5, 2, 2, 4, 36)])] == ["copy.3",
                                                                                 "gather.1"]


def test_input_output_aliases():
    header = ("HloModule jit_step, input_output_alias={ {1}: (3, {}, may-alias), {2, 0}: (4, {1}, "
              "must-alias) }, entry_computation_layout={(f32[2]{0})->f32[2]{0}}")
    assert hc.input_output_aliases(header) == {(1,): (3, ()), (2, 0): (4, (1,))}
    assert hc.input_output_aliases("HloModule m, entry_computation_layout={()->f32[]}") == {}
    assert hc.input_output_aliases(PLAIN) == {(): (2, ())}
    with pytest.raises(AssertionError):
        hc.module_header("ENTRY %main () -> f32[] {")


def test_unparsed_instruction_raises():
    """A line of a computation that the reader does not understand fails the check instead of
    being skipped (a check must not pass by not seeing an instruction)."""
    text = PLAIN.replace("  %slot_mapping.1 = s32[4]{0} parameter(3)",
                         "  %slot_mapping.1 = s32[4]{0} parameter (3)")
    with pytest.raises(ValueError, match="unparsed HLO instruction in main.1"):
        hc.instructions(text)
    with pytest.raises(ValueError):
        hc.assert_in_place(text, CACHE)


def test_snippet_without_computations():
    """Instruction lines outside any computation (no header) are read too."""
    text = f"""
  %p = {U8} parameter(0)
  %copy.2 = {U8} copy(%p)
  %copy.3 = u8[3,2,2,4,37]{{4,3,2,1,0}} copy(%p)
  %copy_fusion = {U8} fusion(%p), kind=kLoop, calls=%fused_copy
  ROOT %nvfp4 = {U8} custom-call(%a, %b, %copy.2), {STORE}
"""
    assert [i.name for i in hc.cache_copies(text, [CACHE])] == ["copy.2", "copy_fusion"]
    assert [i.name for i in hc.cache_copies(text)] == ["copy.2", "copy.3", "copy_fusion"]
    assert len(hc.store_calls(text)) == 1
    assert hc.store_computations(text) == set()
