"""One pytest_test per tests/*_test.py, with the environment its name implies."""

load("//tools/pytest:defs.bzl", "pytest_test")

# Unless gpu-tagged, tests run on the CPU only (this also silences
# jax-cuda13-plugin's cuDNN traceback on machines without a GPU).
CPU_ENV = {"JAX_PLATFORMS": "cpu"}

# Every backend on CPU: Pallas interpreters, Triton's interpreter. NPROC sizes XLA's CPU thread
# pool, which the Mosaic GPU interpreter's blocking callbacks exhaust on 2 cores (a hang: see
# tests/conformance.py, which sets the same default for runs outside Bazel).
INTERPRET_ENV = dict(CPU_ENV, FORGEAX_INTERPRET = "1", NPROC = "8")

# TRITON_INTERPRET must be set before `import triton`: its own process/target.
TRITON_INTERPRET_ENV = dict(INTERPRET_ENV, TRITON_INTERPRET = "1")

# Tests that need several devices get 8 CPU devices.
PARALLEL_ENV = dict(CPU_ENV, XLA_FLAGS = "--xla_force_host_platform_device_count=8")

def default_settings(src):
    """Size, env and data of the test file `src` from its name.

    lowering*_test.py: cross-lowering on CPU, no interpreter.
    <suite>_triton_interpret_test.py: re-exports <suite>_test.py's tests (carried
      as data) for the Triton backend alone, in Triton's interpreter.
    *_parallel_test.py: shard_map tests over 8 CPU devices.
    anything else: every backend, Pallas kernels in their interpreters.
    """
    if src.startswith("lowering"):
        return {"size": "medium", "env": CPU_ENV}
    if src.endswith("_triton_interpret_test.py"):
        suite = src[:-len("_triton_interpret_test.py")] + "_test.py"
        return {"size": "large", "data": [suite], "env": dict(TRITON_INTERPRET_ENV, FORGEAX_TEST_BACKENDS = "triton")}
    if src.endswith("_parallel_test.py"):
        return {"size": "large", "env": PARALLEL_ENV}
    return {"size": "large", "env": INTERPRET_ENV}

def pytest_tests(srcs, deps, overrides = {}):
    """A pytest_test named <file> for each file in srcs.

    Args:
      srcs: test files (*_test.py).
      deps: deps of every target.
      overrides: target name -> dict of pytest_test arguments that replace the
        defaults (size, env, shard_count, data, tags, ...); its deps are added to `deps`.
    """
    for src in srcs:
        name = src[:-len(".py")]
        kwargs = default_settings(src)
        kwargs.update(overrides.get(name, {}))
        pytest_test(
            name = name,
            srcs = [src],
            deps = deps + kwargs.pop("deps", []),
            **kwargs
        )
