#!/usr/bin/env bash
# The linter (ruff) and the type checker (mypy) on src/, with the settings of pyproject.toml;
# fails if either reports anything. Their versions are pinned in constraints.txt (the dev extra).
#
#   bash scripts/lint.sh         what CI runs
#   bash scripts/lint.sh --all   also the findings that pyproject.toml's TEMPORARY lists set
#                                aside (files being rewritten); reports them, fails on them too
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--all" ]; then
    # mypy: the same settings without the TEMPORARY blocks (each runs to the next blank line).
    config="$(mktemp --suffix=.toml)"
    trap 'rm -f "$config"' EXIT
    awk '/^# TEMPORARY:/ {skip = 1} skip && /^$/ {skip = 0; next} !skip' pyproject.toml > "$config"
    rc=0
    python -m ruff check --config 'lint.per-file-ignores = {}' --output-format concise src || rc=1
    python -m mypy --config-file "$config" || rc=1
    exit "$rc"
fi

rc=0
python -m ruff check src || rc=1
python -m mypy || rc=1
exit "$rc"
