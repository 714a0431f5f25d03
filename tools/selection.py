"""Lists every op's selection rules and re-derives each rule's claim from its evidence.

    bazel run //tools:selection                # the rules, op by op
    bazel run //tools:selection -- --check     # exit 1 if a claim no longer holds in its evidence

A rule (ops/rules/<op>.json) names a committed result file and the comparisons it rests on
(`evidence.claims`, see forgeax/core/selection.py); --check reads each file again and fails
when a number no longer supports the rule, so a rerun benchmark that changes the verdict
cannot leave a stale rule behind.
"""

from __future__ import annotations

import argparse
import os
import sys

from forgeax.core import OPS
from forgeax.core.selection import check_claims
import forgeax.ops  # noqa: F401 - defines the built-in ops


def _repository_root() -> str:
    # Under `bazel run` the workspace is BUILD_WORKSPACE_DIRECTORY; else this file's parent's parent.
    return os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="re-derive each rule's claims from its evidence")
    parser.add_argument("--root", default=_repository_root(), help="where benchmarks/results/ lives")
    args = parser.parse_args(argv)
    failures: list[str] = []
    for name in sorted(OPS):
        op = OPS[name]
        priority = {p: list(op.selection.priority.get(p, ())) for p in ("gpu", "tpu")}
        print(f"{name}: priority {priority}")
        for rule in op.selection.rules:
            where = f"{rule.platform} {'/'.join(rule.devices) or 'any device'}"
            print(f"  {rule.id} [{rule.calls}, {where}] when {dict(rule.when)} -> {list(rule.prefer)}")
            print(f"      {rule.why}  ({rule.evidence['file']})")
            if args.check:
                problems = check_claims(rule, args.root)
                failures += problems
                print("      claims: " + ("hold" if not problems else "FAIL: " + "; ".join(problems)))
    if args.check:
        print(f"{'all claims hold' if not failures else f'{len(failures)} claims fail'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
