#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh virtual environment outside the checkout (with
# the train extra, versions from constraints.txt) and runs the command from there: a file
# the package needs but the wheel lacks fails here, not on a user's machine.
#   bash scripts/wheel_check.sh            # uses a temporary folder, removed at the end
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python -m build --wheel --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log" >&2; exit 1; }
wheel="$(ls "$tmp"/dist/*.whl)"
echo "wheel: $(basename "$wheel")"
python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["flt/__init__.py", "flt/py.typed", "licenses/LICENSE", "licenses/CITATION.cff"]
missing = [n for n in need if not any(name.endswith(n) for name in names)]
if missing:
    sys.exit(f"wheel_check: the wheel lacks {missing}")
print(f"wheel_check: {len(names)} files, LICENSE and CITATION.cff included")
PY

python -m venv "$tmp/venv"
# Run from outside the checkout so that nothing imports the source tree by accident.
cd "$tmp"
unset PYTHONPATH
"$tmp/venv/bin/python" -m pip install --quiet -c "$repo/constraints.txt" "flt-attention[train] @ file://$wheel"
reported="$("$tmp/venv/bin/flt" --version)"
echo "$reported"
if [ "$reported" != "flt $version" ]; then
    echo "wheel_check: flt --version says '$reported', pyproject.toml's version is $version" >&2
    exit 1
fi
"$tmp/venv/bin/flt" --help >/dev/null
"$tmp/venv/bin/python" -c "import flt, sys; assert '$repo' not in flt.__file__, flt.__file__; print('imported from', flt.__file__)"
"$tmp/venv/bin/flt" train lm --preset smoke --out-dir "$tmp/run" --threads 1 --no-progress --no-plots | tail -n 3
test -f "$tmp/run/summary.json"
echo "wheel_check: the installed wheel trains"
