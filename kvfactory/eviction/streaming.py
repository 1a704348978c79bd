"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

The first tokens soak up attention mass whatever they say ("attention sinks"); keeping ``n_sink``
of them beside a window of recent tokens keeps a model fluent far beyond the window. Each kept token
keeps its original position, as in kvpress's ``StreamingLLMPress``; the paper numbers positions
within the cache (keys re-rotated), which kvfactory never does (keys are stored after RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfactory.eviction.window import WindowPolicy


@dataclass
class StreamingLLMPolicy(WindowPolicy):
    """Attention sinks (4, the paper's choice) plus the most recent tokens."""

    n_sink: int = 4
