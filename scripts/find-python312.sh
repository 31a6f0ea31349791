#!/usr/bin/env bash
# Print the path of a working Python 3.12 interpreter, or explain what to install and exit 1.
# Order: $PYTHON, python3.12 on PATH (if it really runs: pyenv shims fail unless selected),
# pyenv's versions, common system locations.
set -u
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
command -v python3.12 >/dev/null 2>&1 && candidates+=("$(command -v python3.12)")
# PISFT_PY312_ROOTS / PISFT_PY312_PATHS replace the default search places (used by the tests).
for root in ${PISFT_PY312_ROOTS-"${PYENV_ROOT:-}" "$HOME/.pyenv" /root/.pyenv}; do
  [ -n "$root" ] || continue
  for p in "$root"/versions/3.12*/bin/python3.12; do [ -x "$p" ] && candidates+=("$p"); done
done
for p in ${PISFT_PY312_PATHS-/usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python3.12/bin/python3.12}; do
  candidates+=("$p")
done
for c in "${candidates[@]}"; do
  if [ -x "$c" ] || command -v "$c" >/dev/null 2>&1; then
    if "$c" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$c"
      exit 0
    fi
  fi
done
echo "error: no working Python 3.12 found (LeRobot 0.6.1 needs Python 3.12). Install it, e.g. 'apt-get install python3.12 python3.12-venv' or 'pyenv install 3.12', or set PYTHON=/path/to/python3.12." >&2
exit 1
