#!/usr/bin/env bash
# Refresh requirements/lock.txt: resolve every dependency anew (newest releases that fit pyproject.toml) in a
# throw-away virtual environment, and write down what was installed. Run through `make lock`, then
# `make test`: commit the new lock only when the suite passes with it.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TORCH_SPEC:=torch==2.13.0}"
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$TORCH_SPEC" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$venv/bin/python" -m pip install -q -e '.[test,otlp]'
{
  echo "# The versions CI last passed with: the Makefile installs with '-c requirements/lock.txt'."
  echo "# Refresh with 'make lock' (requirements/lock.sh), then run 'make test' before committing it."
  echo "# torch is left out: the Makefile pins it (TORCH_SPEC) and installs it first."
  echo "# Made with $("$venv/bin/python" --version) on $(uname -sm)."
  "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -viE '^(torch|loraplex)==' | LC_ALL=C sort -f
} > requirements/lock.txt.new
mv requirements/lock.txt.new requirements/lock.txt
echo "wrote requirements/lock.txt ($(grep -c '==' requirements/lock.txt) packages)"
