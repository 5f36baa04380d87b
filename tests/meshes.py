"""Devices for the multi-device tests: the GPUs when there are enough for the mesh, else the
CPU devices (8 virtual ones, tests/conftest.py). A mesh larger than both skips the test."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


def _devices():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    return gpus or jax.devices("cpu")


DEVICES = _devices()


def make_mesh(shape, names):
    n = int(np.prod(shape))
    devices = DEVICES if n <= len(DEVICES) else jax.devices("cpu")
    if n > len(devices):
        pytest.skip(f"needs {n} devices, {len(devices)} available")
    return Mesh(np.array(devices[:n]).reshape(shape), names)
