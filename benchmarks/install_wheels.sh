# Sourced (not run) by benchmarks/gpu_session.sh and gpu_host_session.sh, from the repository root
# on the device machine: sets REPO and OUT (created), installs the carried wheels (.whl/, dist/)
# into /tmp/site once per machine (several sessions may run side by side on different GPUs), and
# links the examples, which are not in the wheel, as forgeax.examples (as in the Bazel tree).
# Exits the calling script when the install fails. The caller sets PYTHONPATH.
REPO=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site/forgeax ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl dist/*.whl || exit 1
[ -e /tmp/site/forgeax/examples ] || ln -s "$REPO/examples" /tmp/site/forgeax/examples
