#!/usr/bin/env bash
# Install flt with its test dependencies (torch pinned to the CPU build) and run the tests.
# pytest's exit code 5 (no tests collected) counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -c constraints.txt -e ".[dev,train,mol,graph,vision,triton,hf,qm9]"
# Optional peers for the agreement tests; their tests skip (and say so) if this fails.
python -m pip install --quiet --no-deps -r requirements-peers.txt \
    || echo "note: peer packages could not be installed; their agreement tests will be skipped" >&2
set +e
python -m pytest -q -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
