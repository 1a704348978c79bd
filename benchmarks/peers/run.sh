#!/usr/bin/env bash
# One command for the kvpress peer: set up its virtualenv (once), then run every press x ratio
# (plus the no-press baseline) on a prompts file.
#   bash benchmarks/peers/run.sh PROMPTS.jsonl OUT.jsonl [run_kvpress.py options...]
# Writes OUT.jsonl (one line per prompt x press x ratio) and OUT.summary.json (accuracy per
# press x ratio x task x context). KVPRESS_VENV overrides the venv folder.
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: bash $0 PROMPTS.jsonl OUT.jsonl [run_kvpress.py options...]" >&2
    exit 2
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${KVPRESS_VENV:-$HERE/.venv-kvpress}"
PROMPTS="$1"; OUT="$2"; shift 2
bash "$HERE/setup_kvpress.sh" "$VENV"
exec "$VENV/bin/python" "$HERE/run_kvpress.py" --prompts "$PROMPTS" --out "$OUT" \
    --summary "${OUT%.jsonl}.summary.json" "$@"
