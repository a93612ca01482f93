#!/usr/bin/env bash
# Install flt with its test dependencies (torch pinned to the CPU build) and run the tests.
# pytest's exit code 5 (no tests collected) counts as a failure. Without arguments (the
# default run) it also runs scripts/lint.sh (ruff and mypy, from the dev extra) and fails if
# that does, after the tests have run.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -c constraints.txt -e ".[dev,train,mol,graph,vision,triton,hf,qm9]"
# Optional peers for the agreement tests; their tests skip (and say so) if this fails.
python -m pip install --quiet --no-deps -r requirements-peers.txt \
    || echo "note: peer packages could not be installed; their agreement tests will be skipped" >&2
lint_rc=0
if [ "$#" -eq 0 ]; then
    bash scripts/lint.sh || lint_rc=$?
fi
set +e
python -m pytest -q -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
if [ "$rc" -eq 0 ] && [ "$lint_rc" -ne 0 ]; then
    echo "scripts/lint.sh failed (see its output above the tests)" >&2
    exit "$lint_rc"
fi
exit "$rc"
