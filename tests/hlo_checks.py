"""Reading compiled HLO text (``jax.jit(f, donate_argnums=...).lower(...).compile().as_text()``)
for the tests: is the NVFP4 cache updated in place, with no copy and no collective?

* ``instructions``: every instruction, with its computation, result type, opcode and callees.
  A line inside a computation that does not parse raises, so no check passes by not seeing.
* ``store_calls``: the ``jax_nvfp4_reshape_and_cache`` custom calls (``is_aliased``: with
  ``output_to_operand_aliasing={{}: (2, {})}``, the cache operand).
* ``store_computations``: computations whose ROOT is the store. XLA:GPU wraps a store whose
  operands are dynamic slices (e.g. in ``lax.scan`` over layers) in
  ``fusion(...), kind=kCustom, calls=%dynamic-slice-fusion``; that fusion is the store itself.
* ``cache_copies``: ops other than in place that write a cache-sized uint8 array (a ``copy``,
  ``copy-start``/``copy-done``, a fusion, ...).
* ``collectives``: all-gather, all-to-all, collective-permute, all-reduce, reduce-scatter, ...,
  and their ``-start``/``-done`` forms.
* ``input_output_aliases``: the module's ``input_output_alias`` (donated arguments).
* ``assert_in_place``: all of the above for one jitted step.
"""

from __future__ import annotations

import dataclasses
import math
import re

STORE_TARGET = "jax_nvfp4_reshape_and_cache"
#: The store's result is its operand 2, the cache (the custom call's own aliasing).
STORE_ALIAS = "output_to_operand_aliasing={{}: (2, {})}"
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter",
               "collective-broadcast", "ragged-all-to-all")
#: Ops that may produce a cache-sized uint8 array without writing its bytes anew.
IN_PLACE = ("parameter", "custom-call", "bitcast", "get-tuple-element", "tuple", "while",
            "conditional", "call", "opt-barrier")
#: Every cache has rank >= 5: plain [num_blocks, 2, ...], grouped and stacked ones more.
CACHE_RANK = 5

_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
                          r"(?P<opcode>[a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\bcalls=(?:\{(?P<many>[^}]*)\}|%?(?P<one>[\w.\-]+))")
_U8 = re.compile(r"\bu8\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
    computation: str | None   # None: a line outside any computation (hand-written snippets)
    name: str
    type: str                 # result type text, e.g. "u8[4,2,2,16,72]{4,3,2,1,0}" or a tuple
    opcode: str
    is_root: bool
    line: str

    @property
    def u8_arrays(self):
        """Dims of every uint8 array in the result type."""
        return [tuple(int(d) for d in m["dims"].split(",") if d) for m in _U8.finditer(self.type)]

    @property
    def calls(self):
        """Names of the computations in ``calls=`` (fusions, async wrappers)."""
        m = _CALLS.search(self.line)
        if not m:
            return ()
        if m["one"]:
            return (m["one"],)
        return tuple(n.strip().lstrip("%") for n in m["many"].split(",") if n.strip())

    @property
    def is_store(self):
        return self.opcode == "custom-call" and f'custom_call_target="{STORE_TARGET}"' in self.line

    def __repr__(self):
        return f"{self.name} = {self.type} {self.opcode}"


def instructions(hlo):
    """Every instruction of the module text, in order."""
    found, computation = [], None
    for line in hlo.splitlines():
        if computation is None or not line[:1].isspace():
            if line.startswith("}"):
                computation = None
                continue
            header = None if line.startswith("HloModule") else _COMPUTATION.match(line)
            if header:
                computation = header["name"]
                continue
        m = _INSTRUCTION.match(line)
        if m:
            found.append(Instruction(computation, m["name"], m["type"], m["opcode"],
                                     bool(m["root"]), line.strip()))
        elif computation is not None and line.strip():
            raise ValueError(f"unparsed HLO instruction in {computation}: {line.strip()}")
    return found


def _parsed(hlo):
    return instructions(hlo) if isinstance(hlo, str) else hlo


def store_calls(hlo):
    """The store custom calls (also those inside a fusion's computation)."""
    return [i for i in _parsed(hlo) if i.is_store]


def is_aliased(store):
    """The store custom call returns its cache operand (operand 2) in place."""
    return STORE_ALIAS in (store.line if isinstance(store, Instruction) else store)


def store_computations(hlo):
    """Computations whose ROOT is the store: an op calling one (XLA:GPU's
    ``dynamic-slice-fusion``, kind=kCustom) is the store itself, not a copy."""
    return {i.computation for i in _parsed(hlo) if i.is_root and i.is_store and i.computation}


def collectives(hlo):
    """Opcodes of every collective, including the async ``-start``/``-done`` forms."""
    return [i.opcode for i in _parsed(hlo) if i.opcode.startswith(COLLECTIVES)]


def cache_copies(hlo, cache_shapes=None):
    """Instructions other than in place that write a cache-sized uint8 array.

    Cache-sized: with ``cache_shapes`` (global and/or per-device shapes), a uint8 array of as
    many bytes as one of them, of any rank (a reshaped copy is a copy); without, any uint8
    array of rank >= 5. In place: ``IN_PLACE`` opcodes, and ops calling a store computation.
    A ``copy-start``/``copy-done`` pair is reported as both."""
    parsed = _parsed(hlo)
    stores = store_computations(parsed)
    sizes = None if cache_shapes is None else {math.prod(s) for s in cache_shapes}
    found = []
    for i in parsed:
        if i.opcode in IN_PLACE or stores.intersection(i.calls):
            continue
        arrays = i.u8_arrays
        if sizes is None:
            hit = any(len(dims) >= CACHE_RANK for dims in arrays)
        else:
            hit = any(math.prod(dims) in sizes for dims in arrays)
        if hit:
            found.append(i)
    return found


def module_header(hlo):
    """The ``HloModule ...`` line."""
    first = hlo.lstrip().split("\n", 1)[0]
    assert first.startswith("HloModule"), first[:200]
    return first


def _index(text):
    return tuple(int(d) for d in text.replace(" ", "").split(",") if d)


def input_output_aliases(hlo):
    """The module's ``input_output_alias``: {output index: (parameter number, parameter
    index)}, e.g. {(): (2, ())} for a store with the cache donated; {} without."""
    header = module_header(hlo)
    start = header.find("input_output_alias={")
    if start < 0:
        return {}
    depth, i = 0, start + len("input_output_alias=")
    for end in range(i, len(header)):
        depth += {"{": 1, "}": -1}.get(header[end], 0)
        if depth == 0:
            break
    body = header[i + 1:end]
    entries = re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\}", body)
    assert len(entries) == body.count(":"), body
    return {_index(out): (int(param), _index(index)) for out, param, index in entries}


def assert_in_place(hlo, cache_shape, *, aliases=None, num_stores=1, cache_shapes=None):
    """The cache is updated in place: no collective; no copy of a cache (``cache_copies`` with
    ``cache_shapes``); ``num_stores`` store calls, each on a uint8 ``cache_shape`` (per
    device) array and aliasing its cache operand; and the module's ``input_output_alias`` is
    exactly ``aliases``, {output index: parameter number or (number, index)}; by default
    {(): 2}, the donated cache of ``reshape_and_cache(key, value, cache, ...)``."""
    parsed = instructions(hlo)
    found = collectives(parsed)
    assert found == [], found
    copies = cache_copies(parsed, cache_shapes)
    assert copies == [], copies
    stores = store_calls(parsed)
    assert len(stores) == num_stores, stores
    for store in stores:
        assert store.u8_arrays == [tuple(cache_shape)], (store, cache_shape)
        assert is_aliased(store), store.line
    expected = {(): 2} if aliases is None else aliases
    expected = {out: (p, ()) if isinstance(p, int) else p for out, p in expected.items()}
    assert input_output_aliases(hlo) == expected, module_header(hlo)
