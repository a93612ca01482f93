#!/usr/bin/env bash
# The linter (ruff) and the type checker (mypy) on src/, with the settings of pyproject.toml;
# fails if either reports anything. Their versions are pinned in constraints.txt (the dev extra).
# scripts/test.sh runs this before the tests, so CI does too.
set -euo pipefail
cd "$(dirname "$0")/.."

rc=0
python -m ruff check src || rc=1
python -m mypy || rc=1
exit "$rc"
