"""The tensor-parallel decode step of stacked layers across processes: two local processes
(``jax.distributed.initialize`` on 127.0.0.1, 4 CPU devices each) run it on the global mesh of
8 devices, and every addressable shard of every output (attention and cache) must hold the
bytes of the same step in this single process on its 8 CPU devices (tests/conftest.py), which
in turn equal a single-device run (tests/test_stacked_layers_tp.py). The worker is
tests/multiprocess_worker.py; it also checks the compiled HLO (no collective, no cache copy,
the cache aliased).

Bounded in time (``TIMEOUT_S`` for both processes together); the processes are killed, and
waited for, whatever happens.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import multiprocess_worker as worker

NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 4
#: Both processes start JAX, compile two steps and run them: ~20 s on 2 cores, measured.
TIMEOUT_S = 300
WORKER = pathlib.Path(worker.__file__)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_outputs(path):
    """Runs the cases on this process's first 8 CPU devices; saves every output."""
    devices = jax.devices("cpu")
    count = NUM_PROCESSES * DEVICES_PER_PROCESS
    if len(devices) < count:
        pytest.skip(f"needs {count} CPU devices in this process, {len(devices)} available")
    mesh = Mesh(np.array(devices[:count]), ("tp",))
    saved = {}
    for name, (fn, args, specs, donate) in worker.cases(mesh).items():
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        for i, out in enumerate(jax.jit(fn, donate_argnums=donate)(*placed)):
            saved[f"{name}_{i}"] = np.asarray(out)
    np.savez(path, **saved)
    return saved


def test_two_processes_match_one(tmp_path):
    expected = tmp_path / "expected.npz"
    _single_process_outputs(expected)
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_PROCESSES", None)
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(NUM_PROCESSES)]
    processes = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(
                    [sys.executable, str(WORKER), coordinator, str(NUM_PROCESSES), str(i),
                     str(expected)], stdout=out, stderr=subprocess.STDOUT, env=env,
                    cwd=str(WORKER.parent)))
        deadline = time.monotonic() + TIMEOUT_S
        codes = []
        for p in processes:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.wait()
    text = "\n".join(f"--- process {i}:\n{log.read_text()[-4000:]}" for i, log in enumerate(logs))
    assert codes is not None, f"timed out after {TIMEOUT_S} s\n{text}"
    assert codes == [0] * NUM_PROCESSES, f"exit codes {codes}\n{text}"
    for i, log in enumerate(logs):
        assert f"OK process {i}:" in log.read_text(), text
