#!/usr/bin/env bash
# The GPU check in one call, for a machine with CUDA and no package index (the lent H200: its own
# Python with torch and lightning, no jsonargparse). Missing pure-Python packages come from .whl/
# (fill it with scripts/gpu_wheels.sh where pip works, and carry it along); nothing is fetched. The
# package runs from this checkout (PYTHONPATH), not installed. Results go to $OUT (or ./gpu-results),
# which must be empty; see scripts/gpu_check.py. `--rehearse` runs the same steps on CPU, quickly.
# PYTHON picks the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
site="${TMPDIR:-/tmp}/deeppool-gpu-site"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || { echo "gpu check: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py --out "${OUT:-gpu-results}" "$@"
