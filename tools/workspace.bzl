"""WORKSPACE setup for forgeax on Bazel 4.2.3 (Debian bazel-bootstrap) with no GitHub/BCR.

Usage in a WORKSPACE (this repo, or a consumer after local_repository(name = "forgeax")):

    load("@forgeax//tools:workspace.bzl", "forgeax_workspace")
    forgeax_workspace()
"""

# Labels in this file are resolved relative to the forgeax repository (load()
# labels and Label(...) both are), so the same file works from this workspace
# and from a consumer's local_repository(name = "forgeax", ...).
load("//tools:python_venv.bzl", "python_venv")

def _stub_repo_impl(rctx):
    for path, content in rctx.attr.files.items():
        rctx.file(path, content, executable = path.endswith(".sh"))

# A repository made of the given files (path -> content).
stub_repo = repository_rule(
    implementation = _stub_repo_impl,
    attrs = {"files": attr.string_dict(mandatory = True)},
)

def _forwarders(names):
    return "".join([
        "def %s(**kwargs):\n    native.%s(**kwargs)\n\n" % (n, n)
        for n in names
    ])

_RULES_CC = {
    "WORKSPACE": 'workspace(name = "rules_cc")\n',
    "BUILD.bazel": "",
    "cc/BUILD.bazel": """package(default_visibility = ["//visibility:public"])

alias(
    name = "toolchain_type",
    actual = "@bazel_tools//tools/cpp:toolchain_type",
)
""",
    "cc/defs.bzl": '"""Offline stand-in for @rules_cc: forwards to Bazel 4 native rules."""\n\n' + _forwarders([
        "cc_binary",
        "cc_import",
        "cc_library",
        "cc_proto_library",
        "cc_test",
        "cc_toolchain",
        "cc_toolchain_suite",
        "objc_import",
        "objc_library",
    ]),
}

_RULES_JAVA = {
    "WORKSPACE": 'workspace(name = "rules_java")\n',
    "BUILD.bazel": "",
    "java/BUILD.bazel": 'package(default_visibility = ["//visibility:public"])\n',
    "java/defs.bzl": '"""Offline stand-in for @rules_java: forwards to Bazel 4 native rules."""\n\n' + _forwarders([
        "java_binary",
        "java_import",
        "java_library",
        "java_lite_proto_library",
        "java_package_configuration",
        "java_plugin",
        "java_proto_library",
        "java_runtime",
        "java_test",
        "java_toolchain",
    ]),
}

# Same load path as real rules_python, so BUILD files need no change if the
# project later moves to a Bazel/rules_python that can be fetched or vendored.
_RULES_PYTHON = {
    "WORKSPACE": 'workspace(name = "rules_python")\n',
    "BUILD.bazel": "",
    "python/BUILD.bazel": 'package(default_visibility = ["//visibility:public"])\n',
    "python/defs.bzl": '''"""Offline stand-in for @rules_python//python:defs.bzl: Bazel 4 native rules."""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")

py_runtime_pair = _py_runtime_pair

''' + _forwarders([
        "py_binary",
        "py_library",
        "py_runtime",
        "py_test",
    ]),
}

_REMOTE_COVERAGE_TOOLS = {
    "WORKSPACE": 'workspace(name = "remote_coverage_tools")\n',
    "BUILD.bazel": """# Offline stand-in: every test rule references these at analysis time;
# only `bazel coverage` would run them.
package(default_visibility = ["//visibility:public"])

sh_binary(
    name = "coverage_report_generator",
    srcs = ["unavailable.sh"],
)

sh_binary(
    name = "lcov_merger",
    srcs = ["unavailable.sh"],
)
""",
    "unavailable.sh": """#!/bin/sh
echo "remote_coverage_tools is not available offline: bazel coverage is unsupported" >&2
exit 1
""",
}

# buildifier: disable=unnamed-macro
def bazel4_offline_repos():
    """Defines the repos that Bazel 4.2's default WORKSPACE suffix would download from GitHub.

    Must run before anything else in WORKSPACE (the suffix only adds them if missing).
    """
    for name, files in [
        ("rules_cc", _RULES_CC),
        ("rules_java", _RULES_JAVA),
        ("remote_coverage_tools", _REMOTE_COVERAGE_TOOLS),
        ("rules_python", _RULES_PYTHON),
    ]:
        # A workspace that already defines one (e.g. a vendored rules_python) keeps it.
        if not native.existing_rule(name):
            stub_repo(name = name, files = files)

# buildifier: disable=unnamed-macro
def forgeax_workspace(requirements_lock = Label("//:requirements_lock.txt"), python = "python3.12"):
    """Everything forgeax needs: offline stubs, the @pypi venv + Python toolchain.

    Args:
      requirements_lock: hashed pip lock for @pypi. Default: forgeax's own
        //:requirements_lock.txt (also for consumers, so they get the versions
        forgeax is tested with).
      python: base interpreter name or path; PYTHON_VENV_BASE overrides it, and
        pyenv's 3.12+ versions are tried after it.
    """
    bazel4_offline_repos()
    python_venv(
        name = "pypi",
        requirements_lock = requirements_lock,
        python = python,
    )
    native.register_toolchains("@pypi//:py_toolchain")
