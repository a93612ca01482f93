#!/usr/bin/env bash
# Install flt with its test dependencies, every version from the lock in constraints.txt
# (torch the CPU build), and run the tests. pytest's exit code 5 (no tests collected) counts
# as a failure. Without arguments (the default run) it also runs scripts/lint.sh (ruff and
# mypy, from the dev extra) and fails if that does, after the tests have run; and it runs the
# suite in a shuffled order (pytest-random-order, from the dev extra): the modules in a random
# order and the tests of each module too, from a fixed seed, so that a test that leaks state
# into another fails, every time, in the run that has it. The bucket is the module, not the
# whole suite, so a module's fixtures are built once, as in the plain order. To run that
# order again: python -m pytest -p random_order --random-order-bucket=module --random-order-seed=SEED
# The default run is also spread over two processes (-n 2, pytest-xdist from the dev extra);
# each collects the suite in the same shuffled order and takes tests from it, so a test must
# keep its files, caches and ports to itself (tmp_path, a free port), as the suite's do. A
# module whose tests both processes take builds its module fixtures once in each.
set -euo pipefail
cd "$(dirname "$0")/.."
# The distribution was called flt before 0.2.0: an editable install of this project under that
# name would stay on sys.path beside the new one and could shadow this checkout, so it goes
# (only if it is this project: the unrelated package of that name on the index is left alone).
if python -m pip show flt 2>/dev/null | grep -q '^Summary: FourierLearner'; then
    python -m pip uninstall --quiet --yes flt
fi
python -m pip install --quiet -c constraints.txt -e ".[dev,docs,train,mol,graph,vision,triton,hf,qm9]"
# Optional peers for the agreement tests; their tests skip (and say so) if this fails.
python -m pip install --quiet --no-deps -r requirements-peers.txt \
    || echo "note: peer packages could not be installed; their agreement tests will be skipped" >&2
lint_rc=0
order=()
if [ "$#" -eq 0 ]; then
    bash scripts/lint.sh || lint_rc=$?
    order=(-n 2 -p random_order --random-order-bucket=module --random-order-seed=4545)
fi
set +e
# -ra: the summary names every test that failed, errored or was skipped, and why.
python -m pytest -q -ra ${order[@]+"${order[@]}"} "$@"
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
