#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the pure-Python packages the GPU machine lacks, for its Python
# 3.12: jsonargparse with what its `signatures` extra needs. Run it where pip reaches PyPI, then
# carry .whl to the GPU machine, where scripts/gpu_check.sh installs them without an index.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0
ls .whl
