"""Counts JUnit test cases in Bazel's test.xml files (stdlib only).

    python3 tools/count_tests.py [--since EPOCH_SECONDS] TESTLOGS_DIR...

Prints one line per test.xml with failures, then a last line exactly of the form

    N passed, N failed, N skipped

and exits 1 if any test case failed (or errored), 2 if no test.xml was found,
else 0. A <testcase> counts as failed if it has a <failure> or <error> child,
skipped if it has <skipped>, passed otherwise. Test-level errors that Bazel
records itself (a crash, a timeout: a test.xml with one synthetic <testcase>
holding an <error>) count as one failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET


def _count(path: str) -> tuple[int, int, int, list[str]]:
    passed = failed = skipped = 0
    failures = []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return 0, 1, 0, ["unreadable XML (%s)" % e]
    cases = list(root.iter("testcase"))
    if not cases:
        # A suite-level error with no test case (e.g. a collection error).
        for suite in ([root] if root.tag == "testsuite" else list(root.iter("testsuite"))):
            if int(suite.get("errors", "0") or 0) + int(suite.get("failures", "0") or 0) > 0:
                failed += 1
                failures.append(suite.get("name", "?"))
    for case in cases:
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed += 1
            failures.append("%s::%s" % (case.get("classname", ""), case.get("name", "?")))
        elif "skipped" in tags:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("testlogs", nargs="+", help="bazel-testlogs directories")
    ap.add_argument("--since", type=float, default=None,
                    help="only count test.xml files modified at or after this time (epoch seconds)")
    a = ap.parse_args(argv)

    total_p = total_f = total_s = files = 0
    for top in a.testlogs:
        if not os.path.isdir(top):
            print("count_tests: %s: no such directory (nothing ran there?)" % top, file=sys.stderr)
            continue
        for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
            dirnames.sort()
            if "test.xml" not in filenames:
                continue
            path = os.path.join(dirpath, "test.xml")
            if a.since is not None and os.path.getmtime(path) < a.since:
                continue
            files += 1
            p, f, s, failures = _count(path)
            total_p, total_f, total_s = total_p + p, total_f + f, total_s + s
            for name in failures:
                print("FAILED %s: %s" % (os.path.relpath(dirpath, top), name))
    if files == 0:
        print("count_tests: no test.xml found under %s" % " ".join(a.testlogs), file=sys.stderr)
    print("%d passed, %d failed, %d skipped" % (total_p, total_f, total_s))
    if total_f:
        return 1
    return 0 if files else 2


if __name__ == "__main__":
    sys.exit(main())
