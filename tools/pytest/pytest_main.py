"""Runs pytest under `bazel test` (used by //tools/pytest:defs.bzl%pytest_test).

- test files arrive as argv (runfiles-relative paths; cwd is the runfiles root)
- writes JUnit XML to $XML_OUTPUT_FILE so Bazel's test.xml has per-test cases
- honours Bazel test sharding (shard_count = N) by round-robin over collected items
- turns off pytest's cache and keeps hypothesis' example database in
  $TEST_TMPDIR (runfiles are not a place to write)
"""
import os
import sys

if os.environ.get("TEST_TMPDIR"):
    os.environ.setdefault(
        "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(os.environ["TEST_TMPDIR"], ".hypothesis")
    )

import pytest  # noqa: E402


class _BazelShard:
    def __init__(self, index, total):
        self.index, self.total = index, total

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        keep = [it for i, it in enumerate(items) if i % self.total == self.index]
        drop = [it for i, it in enumerate(items) if i % self.total != self.index]
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)


def main():
    args = ["-p", "no:cacheprovider", "-o", "console_output_style=classic"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml]
    plugins = []
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total > 1:
        plugins.append(_BazelShard(int(os.environ["TEST_SHARD_INDEX"]), total))
        # Tell Bazel this runner understands sharding.
        status = os.environ.get("TEST_SHARD_STATUS_FILE")
        if status:
            open(status, "a").close()
    # `bazel test --test_filter=expr` -> pytest -k expr
    if os.environ.get("TESTBRIDGE_TEST_ONLY"):
        args += ["-k", os.environ["TESTBRIDGE_TEST_ONLY"]]
    code = pytest.main(args + sys.argv[1:], plugins=plugins)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and total > 1:
        code = 0  # an empty shard is fine
    sys.exit(code)


if __name__ == "__main__":
    main()
