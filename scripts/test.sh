#!/usr/bin/env bash
# The README's test command, verbatim (tests/test_examples.py checks that the README shows this
# line); .ci/run runs this file, so what CI tests is what a new user runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[test]" && .venv/bin/python -m pytest -q
