"""Reports that print for a reader: a cache's memory and a selector's routing, still dicts of
numbers for code (``report["bytes_per_token"]``), whose ``str()`` is a few readable lines."""

from __future__ import annotations

MIB = 1 << 20


class MemorySummary(dict):
    """``KVCache.memory_report()``: bytes held by a cache; printed in MiB and bytes per token, with
    the full-precision window of quantized caches shown apart."""

    def __str__(self) -> str:
        lines = [f"KV cache: {self['allocated'] / MIB:.2f} MiB allocated ({self['used'] / MIB:.2f} MiB used) "
                 f"for {self['tokens']:,} tokens: {self['bytes_per_token']:,.0f} bytes per token"]
        if "residual" in self:
            lines.append(f"  of which the full-precision window (recent tokens kept unquantized): "
                         f"{self['residual'] / MIB:.2f} MiB")
        if "sliding_allocated" in self:
            lines.append(f"  global layers {self['global_allocated'] / MIB:.2f} MiB, sliding-window layers "
                         f"{self['sliding_allocated'] / MIB:.2f} MiB (their window only)")
        if "peak_allocated" in self:
            lines.append(f"  peak before an eviction: {self['peak_allocated'] / MIB:.2f} MiB")
        if "pool_allocated" in self:
            lines.append(f"  shared pool: {self['pool_allocated'] / MIB:.2f} MiB "
                         f"(every cache of it, free blocks included)")
        return "\n".join(lines)


class RoutingSummary(dict):
    """``KVCache.routing_metrics()``: what a selector read; printed as a sentence per measure, and
    "no decode step routed yet" where the numbers are not defined (NaN in the dict)."""

    def __str__(self) -> str:
        if not self.get("steps"):
            return "routing: no decode step routed yet"
        every = self.get("model_read_fraction", self["read_fraction"])
        lines = [f"routing: {self['steps']:,} decode steps, {self['read_fraction']:.1%} of the routed K/V "
                 f"bytes read per step ({every:.1%} of every layer's)"]
        if self.get("shadow_samples"):
            lines.append(f"  hit rate {self['hit_rate']:.3f}, recall {self['recall']:.3f} (oracle "
                         f"{self['oracle_recall']:.3f}) over {self['shadow_samples']:,} shadow samples")
        else:
            lines.append("  hit rate and recall: no shadow sample taken yet")
        return "\n".join(lines)
