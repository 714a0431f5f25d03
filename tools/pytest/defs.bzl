"""pytest_test: a py_test that runs pytest on its srcs.

Usable from this workspace (load("//tools/pytest:defs.bzl", "pytest_test")) and
from a consumer (load("@forgeax//tools/pytest:defs.bzl", "pytest_test")).
"""

load("@rules_python//python:defs.bzl", "py_test")

# Label(): resolved relative to this file's repository, so it also names
# forgeax's runner when the macro is called from a consumer workspace.
_RUNNER = Label("//tools/pytest:pytest_main.py")

def pytest_test(name, srcs, deps = [], args = [], size = "small", **kwargs):
    """Like py_test, but the srcs are collected and run by pytest.

    Sharding (shard_count = N), `bazel test --test_filter=EXPR` (-> pytest -k EXPR)
    and JUnit XML in bazel-testlogs/.../test.xml (one <testcase> per test) work.

    Args:
      name: target name.
      srcs: pytest files (test_*.py / *_test.py); each is passed to pytest.
        Put shared helper modules in a py_library in deps, not in srcs.
      deps: py_library deps.
      args: extra pytest arguments.
      size: Bazel test size (default "small").
      **kwargs: passed to py_test (tags, shard_count, data, env, timeout, ...).
    """
    py_test(
        name = name,
        srcs = srcs + [_RUNNER],
        main = _RUNNER,
        args = ["$(rootpath %s)" % s for s in srcs] + args,
        # "@pypi" as a string: the calling workspace's @pypi (forgeax_workspace()
        # defines it in both this repo and consumers).
        deps = deps + ["@pypi//:pytest"],
        python_version = "PY3",
        srcs_version = "PY3",
        size = size,
        **kwargs
    )
