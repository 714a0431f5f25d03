"""The pip wheel: built from the same sources Bazel tests, installable, importable.

Builds the wheel with tools/build_wheel.py (what `bazel run //tools:wheel` runs)
from this test's runfiles, installs it with `pip install --no-deps --no-index`
into a fresh venv, and runs `forgeax.ops.rms_norm` in a subprocess whose cwd is
a neutral directory and whose sys.path has neither the runfiles nor the source
tree: only the installed wheel can satisfy `import forgeax`. No network: the new
venv sees this test's third-party packages (jax, numpy, pip) through a .pth file.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest


def _workspace_root() -> str:
    """The forgeax tree this test runs from: the runfiles copy under Bazel."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        root = os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "forgeax"))
        if os.path.isfile(os.path.join(root, "tools", "build_wheel.py")):
            return root
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tmp(tmp_path_factory, name: str) -> str:
    return str(tmp_path_factory.mktemp(name))


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RUNFILES_", "PIP_"))}
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _run(args, cwd):
    res = subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, "%s failed (exit %d):\n%s\n%s" % (args, res.returncode, res.stdout, res.stderr)
    return res.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    root = _workspace_root()
    spec = importlib.util.spec_from_file_location("build_wheel", os.path.join(root, "tools", "build_wheel.py"))
    build_wheel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_wheel)
    path = build_wheel.build_wheel(os.path.join(root, "pyproject.toml"), _tmp(tmp_path_factory, "dist"), root)
    assert os.path.basename(path) == "forgeax-0.1.0-py3-none-any.whl"
    return path


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> str:
    venv = os.path.join(_tmp(tmp_path_factory, "venv"), "v")
    base = getattr(sys, "_base_executable", None) or os.path.join(sys.base_prefix, "bin", "python3")
    _run([base, "-m", "venv", "--without-pip", venv], cwd=os.path.dirname(venv))
    python = os.path.join(venv, "bin", "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=venv).strip()
    assert os.path.realpath(purelib).startswith(os.path.realpath(venv)), purelib
    # This interpreter's site-packages (jax, numpy, pip, ...) go *after* the new
    # venv's own site-packages, where the wheel is installed.
    ours = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    with open(os.path.join(purelib, "_forgeax_wheel_test_deps.pth"), "w") as f:
        f.write("\n".join(ours) + "\n")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir",
          "--disable-pip-version-check", wheel], cwd=venv)
    return python


def test_wheel_maps_repo_root_to_forgeax_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for required in [
        "forgeax/__init__.py",
        "forgeax/ops/__init__.py",
        "forgeax/kernels/__init__.py",
        "forgeax/kernels/common/__init__.py",
        "forgeax/kernels/xla/__init__.py",
        "forgeax/kernels/triton/__init__.py",
        "forgeax/kernels/pallas/__init__.py",
        "forgeax/kernels/pallas/gpu/__init__.py",
        "forgeax/kernels/pallas/tpu/__init__.py",
        "forgeax-0.1.0.dist-info/METADATA",
        "forgeax-0.1.0.dist-info/WHEEL",
        "forgeax-0.1.0.dist-info/RECORD",
    ]:
        assert required in names, "%s missing from the wheel: %s" % (required, sorted(names))
    tops = {n.split("/")[0] for n in names}
    assert tops == {"forgeax", "forgeax-0.1.0.dist-info"}, tops
    stray = [n for n in names if n.startswith(("forgeax/tests/", "forgeax/tools/"))
             or "__pycache__" in n or n.endswith(("BUILD", ".pyc"))]
    assert not stray, stray


def test_wheel_metadata_has_pyproject_dependencies_and_triton_extra(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read("forgeax-0.1.0.dist-info/METADATA").decode().splitlines()
    for line in [
        "Name: forgeax",
        "Version: 0.1.0",
        "Requires-Python: >=3.12",
        "Requires-Dist: jax>=0.11.2",
        "Requires-Dist: jaxlib>=0.11.2",
        "Provides-Extra: triton",
        'Requires-Dist: triton==3.6.0; extra == "triton"',
        'Requires-Dist: jax-triton==0.3.1; extra == "triton"',
    ]:
        assert line in meta, "%r not in METADATA:\n%s" % (line, "\n".join(meta))
    # triton is optional: never an unconditional requirement.
    assert not [m for m in meta if m.startswith("Requires-Dist: triton") and "extra" not in m]


def test_installed_wheel_runs_rms_norm_from_neutral_cwd(venv_python, tmp_path):
    venv = os.path.dirname(os.path.dirname(venv_python))
    script = textwrap.dedent(
        """
        import os
        import sys
        import forgeax
        lazy = [m for m in ("triton", "jax_triton") if m in sys.modules]
        assert not lazy, "import forgeax imported %s eagerly" % lazy
        from forgeax import ops
        import numpy as np
        import jax.numpy as jnp

        venv = os.path.realpath(sys.argv[1])
        for mod in (forgeax, ops):
            assert os.path.realpath(mod.__file__).startswith(venv), "%s imported from %s, not the wheel" % (mod.__name__, mod.__file__)
        assert ops.__name__ == "forgeax.ops"
        assert "ops" not in sys.modules and "kernels" not in sys.modules

        rng = np.random.default_rng(0)
        x = rng.standard_normal((3, 5, 37)).astype(np.float32)
        scale = (1.0 + 0.1 * rng.standard_normal(37)).astype(np.float32)
        y = np.asarray(ops.rms_norm(jnp.asarray(x), jnp.asarray(scale), eps=1e-6))
        ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * scale
        err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert y.shape == x.shape and y.dtype == np.float32, (y.shape, y.dtype)
        assert np.isfinite(y).all() and err < 1e-5, err
        loaded = sorted(m for m in sys.modules if m.startswith("forgeax.kernels."))
        for m in loaded:
            f = os.path.realpath(getattr(sys.modules[m], "__file__", None) or "")
            assert f.startswith(venv), "%s imported from %s" % (m, f)
        print("ok rel_err=%.2e kernels=%s" % (err, loaded))
        """
    )
    cwd = tmp_path / "neutral"
    cwd.mkdir()
    out = _run([venv_python, "-I", "-c", script, venv], cwd=str(cwd))
    assert out.startswith("ok rel_err="), out
