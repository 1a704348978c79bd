"""Sparse decode (page selectors) against DynamicCache: decode speed, bytes read, router latency.

The same measurement as ``benchmarks/decode.py`` (SmolLM2, fp32, 1 thread, prompts of 2048 and
6144 WikiText tokens, batch 1 and 8, 64 new tokens, interleaved runs, medians, ratios to
DynamicCache in the same run), over 16-token pages read by a selector at a read budget, decoded
with ``attn_implementation="kvfactory"`` (sparse reads happen inside kvfactory's attention).
Each selector row adds ``read_fraction`` (KV bytes decode read over all stored, page summaries
included), ``token_read_fraction`` (tokens read over tokens stored, every layer) split into
``always_read_fraction`` (sink, local and new-token pages), ``selected_read_fraction`` and
``whole_read_fraction`` (layers read whole), ``index_bytes_per_step`` (page summaries),
``recall`` (attention mass on the pages read, from the default shadow steps), router p50 / p99
and ``router_p50_share_of_step`` / ``router_p99_share_of_step`` (over one decode step's time).
``paged16/attn`` is the same storage read whole, the lossless reference.
The targets at 6144 tokens and read budget 1/8 (docs/sparse-reads.md): >= 1.3x DynamicCache at
batch 1 and >= 2x at batch 8; router p99 <= 5 % of a decode step.

    python benchmarks/oval.py [--lengths 6144] [--batches 1,8] [--runs 3] [--configs quest/0.125,...]
"""

from __future__ import annotations

from decode import WithAttention, run


def paged(selector: str | None = None, budget: float = 0.125, **options: int | str) -> WithAttention:
    strategies = [{"name": "paged", "page_size": 16}]
    if selector is not None:
        strategies.append({"name": selector, "read_budget": budget, **options})
    return WithAttention({"type": "composite", "strategies": strategies}, "kvfactory")


CONFIGS = {
    "paged16/attn": paged(),
    "quest/0.25": paged("quest", 0.25),
    "quest/0.125": paged("quest", 0.125),
    "quest/0.0625": paged("quest", 0.0625),
    "oval/0.125": paged("oval", 0.125),
    "recent/0.125": paged("recent", 0.125),
    "random/0.125": paged("random", 0.125),
    # true fractions of every stored token (``token_read_fraction``): 1/8 with every layer routed or
    # with the first 2 of 30 read whole and the others at 1/16, and 1/16 with every layer routed (the
    # shipped per-layer split covers layers 2..29 only, so those split evenly); "oval-prefetch" is
    # OVAL's prefetch router (layers 2..29), "oval-gate" its block gate
    **{f"{name}/{budget}/dense0": paged(name, budget, dense_layers=0, layer_budgets="uniform")
       for name in ("quest", "oval", "recent", "random") for budget in (0.125, 0.0625)},
    "quest/0.0625/dense2": paged("quest", 0.0625, dense_layers=2),
    "oval/0.0625/dense2": paged("oval", 0.0625, dense_layers=2),
    "oval-prefetch/0.0625/dense2": paged("oval", 0.0625, dense_layers=2, router="embedded-prefetch"),
    # OVAL's block gate, every layer routed
    **{f"oval-gate/{budget}/dense0": paged("oval", budget, dense_layers=0, layer_budgets="uniform",
                                           router="embedded-gate") for budget in (0.125, 0.0625)},
}

if __name__ == "__main__":
    run(CONFIGS, "oval")
