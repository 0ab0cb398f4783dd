#!/usr/bin/env bash
# The package as a user gets it: build the wheel from this working tree, install it into a fresh virtual
# environment (torch pinned first; pip's cache is reused), then run what the README promises from the repository
# root, where the source tree's adaloss_cli/ and adaloss/ shadow the installed packages, and from another folder.
#
#   bash .ci/check_wheel.sh            (make check-wheel; .ci/run runs it after make test)
#
# To add a check: one `check "what it shows" command args...` line under "Checks" (runs in the repository root with
# the fresh venv first on PATH). A documented example: check "..." run_doc FILE "Its heading" (FILE relative to
# the repository, e.g. README.md or docs/integrations.md). A package the new check needs: add it to EXTRA_PACKAGES
# (installed with torch pinned).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"     # an unpinned torch pulls the newest CUDA build (gigabytes); docs/architecture.md 7
EXTRA_PACKAGES=(lightning accelerate transformers)   # for docs/integrations.md's examples
WORK="$(mktemp -d "${TMPDIR:-/tmp}/adaloss-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/logs"
passed=0
failed=()

check() {  # check "description" command args...: run it, keep its output in a log, report one line
  local what="$1" log="$WORK/logs/$((passed + ${#failed[@]})).log" start=$SECONDS
  shift
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1))
    echo "ok    $what ($((SECONDS - start)) s)"
  else
    failed+=("$what")
    echo "FAIL  $what: $*"
    tail -n 25 "$log" | sed 's/^/      /'
  fi
}

quietly() {  # quietly NAME command args...: run a setup step; on failure show its output's end and stop
  local log="$WORK/logs/$1.log"
  shift
  "$@" >"$log" 2>&1 || { echo "FAIL  $*"; grep -v "is ignored" "$log" | tail -n 25; exit 1; }
}

run_doc() {  # run_doc FILE HEADING: the document's first python block under that heading, as a user pastes it
  local code
  code="$(python "$ROOT/.ci/readme_example.py" "$2" "$1")" || return 1
  python -c "$code"
}

echo "== building the wheel and a fresh venv in $WORK"
# Build from a copy of the working tree (tracked and untracked, not ignored): a stale build/ folder in the tree
# would put deleted modules into the wheel.
mkdir "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$WORK/src"
"$PYTHON" -m venv "$WORK/venv"
PATH="$WORK/venv/bin:$PATH"
export PATH
quietly build pip wheel --no-deps --wheel-dir "$WORK/dist" "$WORK/src"
echo "$TORCH" >"$WORK/constraints.txt"
quietly torch pip install "$TORCH"
quietly install pip install --constraint "$WORK/constraints.txt" "$WORK"/dist/adaloss-*.whl \
  ${EXTRA_PACKAGES[@]+"${EXTRA_PACKAGES[@]}"}
echo "installed $(pip list 2>/dev/null | grep -E '^(adaloss|torch) ' | tr -s ' ' | paste -sd ',' -)"

# -- Checks -------------------------------------------------------------------------------------------------------
cd "$ROOT"
OUT="$WORK/runs"
check "README library example, from the repository root" run_doc README.md "In your own training loop"
check "adaloss configs" adaloss configs
check "adaloss train --config digits" adaloss train --config digits --set training.iterations=3 \
  --set "output.root=$OUT" --quiet
check "python -m adaloss_cli --help" python -m adaloss_cli --help
check "python -m adaloss_cli env" python -m adaloss_cli env
check "adaloss batch sweeps/digits --jobs 2" adaloss batch sweeps/digits --jobs 2 --set training.iterations=2 \
  --out "$OUT/sweep" --quiet
check "adaloss train --nproc-per-node 2" adaloss train --config digits --set training.iterations=2 \
  --set "output.root=$OUT" --nproc-per-node 2 --quiet
cd "$WORK"
check "adaloss validate by name, outside the repository" adaloss validate digits sweeps/digits
check "README library example, outside the repository" run_doc README.md "In your own training loop"
# Outside the repository only: Lightning writes lightning_logs/ and the Trainer trainer_output/ where they run.
check "docs Lightning example" run_doc docs/integrations.md "Lightning"
check "docs Fabric example" run_doc docs/integrations.md "Fabric"
check "docs accelerate example" run_doc docs/integrations.md "accelerate"
check "docs transformers.Trainer example" run_doc docs/integrations.md "transformers.Trainer"

echo "wheel check: ${passed} of $((passed + ${#failed[@]})) checks passed"
[ ${#failed[@]} -eq 0 ]
