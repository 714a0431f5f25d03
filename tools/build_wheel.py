"""bazel run //tools:wheel [-- --out DIR]

Assembles the pure-Python wheel of forgeax from the sources that Bazel put in
this binary's runfiles, i.e. exactly the py_library closure of //ops (the API
and every backend), with metadata from pyproject.toml's [project] table.

The repository root is the package (pyproject's [tool.bazel-wheel]):

    __init__.py  -> forgeax/__init__.py
    ops/...      -> forgeax/ops/...
    kernels/...  -> forgeax/kernels/...

Stdlib only; reproducible (sorted entries, fixed timestamps). Writes
<out>/forgeax-<version>-py3-none-any.whl, where <out> defaults to
$BUILD_WORKSPACE_DIRECTORY/dist (the source tree's dist/ under `bazel run`).

Also importable (tests/wheel_test.py): build_wheel(pyproject, out_dir, root).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import sys
import tomllib
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)
_SKIP_DIRS = {"__pycache__"}
_SKIP_FILES = {"BUILD", "BUILD.bazel"}


def _default_root() -> str:
    # This file is <root>/tools/build_wheel.py; under `bazel run` <root> is the
    # runfiles copy of the workspace, which holds only declared files.
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requires_dist(project: dict) -> list[str]:
    lines = ["Requires-Dist: %s" % dep for dep in project.get("dependencies", [])]
    for extra, deps in sorted(project.get("optional-dependencies", {}).items()):
        lines.append("Provides-Extra: %s" % extra)
        for dep in deps:
            req, _, marker = dep.partition(";")
            cond = 'extra == "%s"' % extra
            if marker.strip():
                cond = "(%s) and %s" % (marker.strip(), cond)
            lines.append("Requires-Dist: %s; %s" % (req.strip(), cond))
    return lines


def metadata(project: dict) -> str:
    lines = [
        "Metadata-Version: 2.1",
        "Name: %s" % project["name"],
        "Version: %s" % project["version"],
    ]
    if "description" in project:
        lines.append("Summary: %s" % project["description"])
    if "requires-python" in project:
        lines.append("Requires-Python: %s" % project["requires-python"])
    lines += _requires_dist(project)
    return "\n".join(lines) + "\n"


def _subpackage_files(root: str, package: str, sub: str):
    top = os.path.join(root, sub)
    if not os.path.isdir(top):
        sys.exit("build_wheel: %s/ is not in the runfiles (%s): add it to deps of //tools:wheel" % (sub, top))
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        names = [f for f in sorted(filenames) if f not in _SKIP_FILES and not f.endswith((".pyc", ".pyo"))]
        if any(f.endswith(".py") for f in names) and "__init__.py" not in names:
            sys.exit("build_wheel: %s has Python files but no __init__.py (it would not be a "
                     "regular package in the wheel): add one, and list it in the BUILD srcs"
                     % os.path.relpath(dirpath, root))
        for f in names:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            yield "%s/%s" % (package, rel), full


def build_wheel(pyproject_path: str, out_dir: str, root: str | None = None, verbose: bool = False) -> str:
    """Writes the wheel into out_dir and returns its path."""
    root = root or _default_root()
    with open(pyproject_path, "rb") as f:
        pyproject = tomllib.load(f)
    project = pyproject["project"]
    cfg = pyproject["tool"]["bazel-wheel"]
    package = cfg["package"]
    dist = re.sub(r"[-_.]+", "_", project["name"]).lower()
    version = project["version"]
    info = "%s-%s.dist-info" % (dist, version)

    init = os.path.join(root, "__init__.py")
    if not os.path.isfile(init):
        sys.exit("build_wheel: %s is missing: //tools:wheel must depend on //:forgeax_init (via //ops)" % init)
    files = [("%s/__init__.py" % package, init)]
    for sub in cfg["subpackages"]:
        files += list(_subpackage_files(root, package, sub))

    entries = []
    for arc, full in sorted(files):
        with open(full, "rb") as f:
            entries.append((arc, f.read()))
    entries.append((info + "/METADATA", metadata(project).encode()))
    entries.append((info + "/WHEEL", (
        "Wheel-Version: 1.0\nGenerator: bazel //tools:wheel\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n").encode()))

    os.makedirs(out_dir, exist_ok=True)
    wheel_path = os.path.join(out_dir, "%s-%s-py3-none-any.whl" % (dist, version))
    tmp_path = wheel_path + ".tmp"
    record = []
    with zipfile.ZipFile(tmp_path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in entries:
            zi = zipfile.ZipInfo(arc, _EPOCH)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append("%s,sha256=%s,%d" % (arc, digest, len(data)))
        record.append(info + "/RECORD,,")
        zi = zipfile.ZipInfo(info + "/RECORD", _EPOCH)
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(zi, "\n".join(record) + "\n")
    os.replace(tmp_path, wheel_path)

    if verbose:
        print("wrote %s (%d files)" % (wheel_path, len(entries) + 1))
        for arc, _ in entries:
            print("  " + arc)
    return wheel_path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pyproject", required=True, help="path to pyproject.toml")
    ap.add_argument("--out", default=None, help="output directory (default: <workspace>/dist)")
    ap.add_argument("--root", default=None, help="package root (default: the runfiles workspace)")
    a = ap.parse_args(argv)
    if a.out:
        # Relative to where `bazel run` was invoked, not to the runfiles.
        out_dir = os.path.join(os.environ.get("BUILD_WORKING_DIRECTORY", "."), a.out)
    else:
        out_dir = os.path.join(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."), "dist")
    build_wheel(a.pyproject, out_dir, a.root, verbose=True)


if __name__ == "__main__":
    main()
