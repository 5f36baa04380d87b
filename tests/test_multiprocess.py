"""The tensor-parallel decode step of stacked layers across processes: two local processes
(``jax.distributed.initialize`` on 127.0.0.1) run it on the global mesh of their devices, and
every addressable shard of every output (attention and cache) must hold the bytes of the same
step in this single process on as many devices. On the CPU each process has 4 devices (8 in
all; this process's 8 CPU devices, tests/conftest.py, which in turn equal a single-device run,
tests/test_stacked_layers_tp.py), or one device each (the GPU form's layout); where two GPUs
are visible, a third test gives each process one GPU (``CUDA_VISIBLE_DEVICES``) and compares
with this process's first two GPUs (issue 24).
The worker is tests/multiprocess_worker.py; it also checks the compiled HLO (no collective, no
cache copy, the cache aliased).

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
from conftest import gpu_devices

NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 4
#: Both processes start JAX, compile two steps and run them: ~20 s on 2 cores, measured.
TIMEOUT_S = 300
#: The GPU form's (CUDA's start in each process, then the same): short enough that a hang is
#: reported before the runbook's own limit (TESTING.md, "On two GPUs").
GPU_TIMEOUT_S = 180
WORKER = pathlib.Path(worker.__file__)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_outputs(path, devices):
    """Runs the cases on ``devices`` (one mesh over all of them); saves every output."""
    mesh = Mesh(np.array(devices), ("tp",))
    saved = {}
    for name, (fn, args, specs, donate) in worker.cases(mesh).items():
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        for i, out in enumerate(jax.jit(fn, donate_argnums=donate)(*placed)):
            saved[f"{name}_{i}"] = np.asarray(out)
    np.savez(path, **saved)
    return saved


def _run_workers(tmp_path, expected, envs, platform, timeout_s=TIMEOUT_S):
    """Starts one worker per environment in ``envs`` (process i gets envs[i]) on ``platform``
    and asserts that every one exits 0 having found its shards equal to ``expected``, within
    ``timeout_s`` for all of them."""
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(len(envs))]
    processes = []
    try:
        for i, (log, env) in enumerate(zip(logs, envs)):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(
                    [sys.executable, str(WORKER), coordinator, str(len(envs)), str(i),
                     str(expected), platform], stdout=out, stderr=subprocess.STDOUT, env=env,
                    cwd=str(WORKER.parent)))
        deadline = time.monotonic() + timeout_s
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
    assert codes is not None, f"timed out after {timeout_s} s\n{text}"
    assert codes == [0] * len(envs), f"exit codes {codes}\n{text}"
    for i, log in enumerate(logs):
        assert f"OK process {i}:" in log.read_text(), text


def _worker_env():
    env = dict(os.environ)
    env.pop("JAX_NUM_PROCESSES", None)
    return env


def _match_on_cpu(tmp_path, devices_per_process):
    """NUM_PROCESSES worker processes of ``devices_per_process`` CPU devices each against this
    process's first as many CPU devices."""
    devices = jax.devices("cpu")
    count = NUM_PROCESSES * devices_per_process
    if len(devices) < count:
        pytest.skip(f"needs {count} CPU devices in this process, {len(devices)} available")
    expected = tmp_path / "expected.npz"
    _single_process_outputs(expected, devices[:count])
    env = _worker_env()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    env["JAX_PLATFORMS"] = "cpu"
    _run_workers(tmp_path, expected, [env] * NUM_PROCESSES, "cpu")


def test_two_processes_match_one(tmp_path):
    _match_on_cpu(tmp_path, DEVICES_PER_PROCESS)


def test_one_device_a_process_on_the_cpu(tmp_path):
    """The GPU form's layout on CPU devices: one device a process."""
    _match_on_cpu(tmp_path, 1)


@pytest.mark.gpu
def test_two_gpu_processes_match_one(tmp_path):
    """Issue 24: one process per GPU, each seeing only its own (``CUDA_VISIBLE_DEVICES``, the
    i-th of this process's visible GPUs), their shards against this process's first two GPUs:
    the same kernels on the same shapes, so the same bytes."""
    gpus = gpu_devices()
    if len(gpus) < NUM_PROCESSES:
        pytest.skip(f"needs {NUM_PROCESSES} GPUs, {len(gpus)} visible")
    expected = tmp_path / "expected.npz"
    _single_process_outputs(expected, gpus[:NUM_PROCESSES])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(NUM_PROCESSES)]
    envs = []
    for i in range(NUM_PROCESSES):
        env = _worker_env()
        env["JAX_PLATFORMS"] = "cuda"
        env["CUDA_VISIBLE_DEVICES"] = ids[i].strip()
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process holds the GPUs' memory too
        envs.append(env)
    _run_workers(tmp_path, expected, envs, "cuda", GPU_TIMEOUT_S)
