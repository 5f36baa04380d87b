"""One process of tests/test_multiprocess.py: ``jax.distributed`` over local processes, the
tensor-parallel decode step of stacked layers on the global mesh, every addressable shard
compared with the bytes of the same step run in a single process.

Run as ``python multiprocess_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID EXPECTED.npz
[PLATFORM]``: PLATFORM ``cpu`` (the default) with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (N CPU devices per process), or ``cuda``
with the process's GPUs in ``CUDA_VISIBLE_DEVICES`` (one per process in the test). Prints an
``OK`` line and exits 0 when every shard matches and the compiled steps are in place; raises
otherwise (the shards are compared first, so a failed HLO check still says whether they
matched).

The cases (also what the single-process side runs, :func:`cases`): a mesh ``("tp",)`` over
every device of every process, G = the number of devices head groups, 2 layers;

* ``vmap``: ``jax.vmap`` over the layers of the grouped store + attention, the ``[L, G, ...]``
  cache sharded ``P(None, "tp")``;
* ``scan``: ``lax.scan`` over the layers, the grouped page pool ``[G, L * num_blocks, ...]``
  sharded ``P("tp")`` (tests/test_stacked_layers_tp.py, the README's recipe).

Both with the cache donated: the compiled HLO must hold no collective and no cache copy here
too (tests/hlo_checks.py).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = 2


def cases(mesh):
    """``{name: (fn, args, specs, donate)}`` of the tensor-parallel steps on ``mesh`` (axis
    ``"tp"``, whose size is the number of head groups)."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import test_stacked_layers_tp as t
    from attention_cases import grouped_decode_step

    groups = mesh.shape["tp"]
    data = t.Data(seed=2026, groups=groups)
    stacked = data.stacked_cache("LG")
    q, key, value, slots = data.step_inputs()
    rest = (slots, data.tables, t.LENS, data.k_scale, data.v_scale)
    heads = P(None, None, "tp")
    small = (P(),) * len(rest)
    vmapped = jax.vmap(grouped_decode_step("HND"), in_axes=(0, 0, 0, 0) + (None,) * len(rest))
    pool = np.ascontiguousarray(np.swapaxes(stacked, 0, 1)).reshape(
        (groups, LAYERS * t.NUM_BLOCKS) + data.group_shape[2:])
    return {
        "vmap": (vmapped, (q, key, value, stacked) + rest,
                 (heads, heads, heads, P(None, "tp")) + small, (3,)),
        "scan": (t._pool_step("HND"), (q, key, value, pool) + rest,
                 (heads, heads, heads, P("tp")) + small, (3,)),
    }


def main(coordinator, num_processes, process_id, expected_path, platform="cpu"):
    import jax

    jax.config.update("jax_platforms", platform)
    # Every parameter given, and no cluster detection (under SLURM, Open MPI or Kubernetes
    # variables it would pick a local rank's GPU, which a process that sees one GPU lacks).
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               cluster_detection_method="deactivate",
                               initialization_timeout=120)
    try:
        run(expected_path)
    finally:
        jax.distributed.shutdown()


def run(expected_path):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    sys.path.insert(0, HERE)
    import hlo_checks as hc

    assert jax.process_count() > 1, jax.process_count()
    devices = jax.devices()
    assert len(devices) > jax.local_device_count(), (devices, jax.local_devices())
    mesh = Mesh(np.array(devices), ("tp",))
    expected = np.load(expected_path)
    checked = 0
    in_place_errors = []
    for name, (fn, args, specs, donate) in cases(mesh).items():
        def placed():
            return [jax.make_array_from_callback(
                        np.shape(a), NamedSharding(mesh, s),
                        lambda index, a=a: np.asarray(a)[index]) for a, s in zip(args, specs)]

        f = jax.jit(fn, donate_argnums=donate)
        compiled = f.lower(*placed()).compile()
        outputs = compiled(*placed())
        for i, out in enumerate(outputs):
            want = expected[f"{name}_{i}"]
            assert out.shape == want.shape, (name, i, out.shape, want.shape)
            assert out.sharding.is_equivalent_to(
                NamedSharding(mesh, specs[0] if i == 0 else specs[3]), out.ndim), out.sharding
            for shard in out.addressable_shards:
                got = np.asarray(shard.data)
                # Bytes: NaN == NaN, -0 != +0.
                assert got.tobytes() == np.ascontiguousarray(want[shard.index]).tobytes(), (
                    name, i, shard.index)
                checked += 1
        # The compiled program's checks after the bytes, so that a pattern the checks do not
        # know (another backend's HLO) cannot hide whether the shards are right.
        cache = args[3]
        local = NamedSharding(mesh, specs[3]).shard_shape(np.shape(cache))
        try:
            hc.assert_in_place(compiled.as_text() or "", local, aliases={(1,): 3},
                               cache_shapes=[np.shape(cache), local])
        except Exception as e:  # a failed check, or HLO the checks cannot read
            in_place_errors.append(f"{name}: {e}")
    print(f"process {jax.process_index()}: {checked} shards equal", flush=True)
    assert not in_place_errors, "\n".join(in_place_errors)
    print(f"OK process {jax.process_index()}: {checked} shards equal, in place", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
