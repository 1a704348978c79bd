#!/usr/bin/env bash
# The harness run in docs/benchmarks.md ("Harness"), with one command: kvfactory's lossless configs
# and transformers' own caches (kvfactory eval), NVIDIA kvpress's presses x ratios on the same
# prompts (run.sh), then one report with both (kvfactory report).
#   bash benchmarks/peers/full_run.sh [OUT] [kvfactory eval options...]     (OUT: results/full)
# Options with --cache replace the default caches (e.g. --cache snapkv@0.75 --cache tova@0.75 for
# kvfactory's eviction policies beside kvpress's presses). Retrieval runs with --question after:
# kvpress compresses the context before the question, so kvfactory's rows are scored the same way.
# Steps whose output exists are skipped (kvpress resumes where it stopped), so an interrupted run
# continues. KVFACTORY picks the kvfactory executable (default: the project's .venv, set up by make).
# kvpress and kvfactory's evaluation run at the same time, one core each.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${1:-results/full}"
shift || true
if [[ -z "${KVFACTORY:-}" ]]; then
    make -C "$ROOT" setup >&2
    "$ROOT/.venv/bin/pip" install -q -c "$ROOT/constraints.txt" -e "$ROOT[peers]" >&2  # QuantizedCache backends
    KVFACTORY="$ROOT/.venv/bin/kvfactory"
fi
CACHES=(--cache dense --cache paged16
        --cache transformers/quanto-int4 --cache transformers/quanto-int2
        --cache transformers/hqq-int4 --cache transformers/hqq-int2
        --cache transformers/sliding-window-1024)
if [[ " $* " == *" --cache "* ]]; then
    CACHES=()
fi
CACHES+=(--question after)
mkdir -p "$OUT"
"$KVFACTORY" eval "${CACHES[@]}" "$@" --out "$OUT" --prompts-only
bash "$HERE/run.sh" "$OUT/prompts.jsonl" "$OUT/kvpress.jsonl" --resume > "$OUT/kvpress.log" 2>&1 &
KVPRESS=$!
if [[ ! -f "$OUT/results.json" ]]; then
    "$KVFACTORY" eval "${CACHES[@]}" "$@" --out "$OUT"
fi
if ! wait "$KVPRESS"; then
    echo "kvpress failed: see $OUT/kvpress.log" >&2
    exit 1
fi
"$KVFACTORY" report "$OUT" --peer-results "$OUT/kvpress.jsonl"
