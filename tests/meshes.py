"""Devices for the multi-device tests: the GPUs when there are any, else the CPU devices (8
virtual ones, tests/conftest.py). A mesh larger than what is there skips the test."""

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
    if n > len(DEVICES):
        pytest.skip(f"needs {n} devices, {len(DEVICES)} available")
    return Mesh(np.array(DEVICES[:n]).reshape(shape), names)
