#!/usr/bin/env bash
# Builds the documentation site into site/ and fails on any warning: a broken link, a page
# missing from the navigation, an unresolved reference or a docstring griffe cannot parse.
# Needs the docs extra: python -m pip install -c constraints.txt -e ".[docs]"
set -euo pipefail
cd "$(dirname "$0")/.."
# The CLI reference imports flt's parsers from this checkout, not from an installed copy.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# NO_MKDOCS_2_WARNING: Material prints a banner about its successor on every build.
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict "$@"
# Every public name of the documented modules has its anchor in the rendered API reference.
python - <<'PY'
import importlib.util, re, sys
spec = importlib.util.spec_from_file_location("docstring_rules", "tests/lab/test_docstrings.py")
rules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rules)
page = open("site/api/index.html", encoding="utf-8").read()
anchors = set(re.findall(r'id="(flt[\w.]*)"', page))
missing = []
for name in rules.DOCUMENTED:
    try:
        module = importlib.import_module(name)
    except ImportError as error:  # the hf extra is absent: its module cannot be checked here
        print(f"docs.sh: note: {name} not importable ({error}); its names were not checked", file=sys.stderr)
        continue
    missing += [f"{name}.{n}" for n in rules.public_names(module) if not n.startswith("__") and f"{name}.{n}" not in anchors]
if missing:
    sys.exit(f"docs.sh: public names missing from the API reference: {missing}")
print(f"docs.sh: the API reference renders every public name of {len(rules.DOCUMENTED)} modules")
PY
