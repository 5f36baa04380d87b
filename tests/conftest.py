"""Test setup: 8 virtual CPU devices (for the sharding tests; set before JAX starts a backend),
CPU as the default device of the session (module-scoped fixtures included) and the GPU as the
default inside tests marked ``gpu``, and the ``gpu`` marker, which skips where no GPU is
visible."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_CPU_DEVICES = 8

# Hypothesis profiles of tests/test_properties.py, picked by JAX_NVFP4_HYPOTHESIS: "ci" (the
# default: few examples, derandomized, for CI's 2 cores) and "long" (a GPU machine; random).
try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
else:
    _hypothesis_settings.register_profile("ci", max_examples=60, derandomize=True,
                                          database=None, print_blob=True)
    # JAX_NVFP4_HYPOTHESIS_EXAMPLES sets the long profile's examples per test (tests/
    # gpu_checks.sh runs it in rounds that fit a time budget).
    _hypothesis_settings.register_profile(
        "long", max_examples=int(os.environ.get("JAX_NVFP4_HYPOTHESIS_EXAMPLES", 2000)),
        database=None, print_blob=True)
    _hypothesis_settings.load_profile(os.environ.get("JAX_NVFP4_HYPOTHESIS", "ci"))


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped where none is visible")
    # For the whole session, before any fixture: a per-test default would come after the
    # module-scoped fixtures, which then ran on the GPU where one was visible.
    jax.config.update("jax_default_device", jax.devices("cpu")[0])


def pytest_collection_modifyitems(config, items):
    if gpu_devices():
        return
    skip = pytest.mark.skip(reason="no GPU visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_device(request):
    """Tests marked gpu run with the GPU as the default device; the others keep the CPU."""
    if "gpu" in request.keywords and gpu_devices():
        with jax.default_device(gpu_devices()[0]):
            yield
    else:
        yield


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Runs the test under Shardy (jax's default) and under GSPMD."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    try:
        yield request.param
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)
