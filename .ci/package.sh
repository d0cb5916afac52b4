#!/usr/bin/env bash
# The release artefacts: `python -m build` makes the sdist, then the wheel from the unpacked sdist (in isolated build
# environments without torch, so a file missing from the sdist, or a version read by importing the package, fails
# here); twine checks both; the wheel is installed into a fresh virtual environment with its dependencies resolved
# under constraints.txt, and .ci/smoke_installed.py checks it from outside the repository.
# Needs the `release` extra in the active environment. Run alone: `. .venv/bin/activate && bash .ci/package.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
twine --no-color check --strict "$tmp"/dist/*

# No pip in the new environment: this pip installs into it (--python). --no-compile skips byte-compiling torch
# (about 15 s of the install); the import below compiles what it uses.
python -m venv --without-pip "$tmp/venv"
python -m pip --python "$tmp/venv/bin/python" install -q --no-compile -c constraints.txt "$tmp"/dist/*.whl
cd "$tmp" && "$tmp/venv/bin/python" -I "$repo/.ci/smoke_installed.py" "$tmp/dist"
