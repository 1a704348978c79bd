"""The evaluation tasks: each runs prompts through caches from ``make_cache()`` and scores the results.

``make_cache`` returns a fresh cache (a transformers ``DynamicCache``, a kvfactory cache or any
transformers ``Cache``) for every prompt. Results are frozen dataclasses, JSON-ready with
``dataclasses.asdict``; greedy decoding and seeded prompts make quality numbers repeatable.
"""

from kvfactory.eval.tasks.multiturn import MultiTurnResult, run_multiturn
from kvfactory.eval.tasks.perplexity import PerplexityResult, run_perplexity
from kvfactory.eval.tasks.retrieval import NEEDLE_NEW_TOKENS, RetrievalResult, run_needle, run_passkey

__all__ = [
    "NEEDLE_NEW_TOKENS", "MultiTurnResult", "PerplexityResult", "RetrievalResult", "run_multiturn",
    "run_needle", "run_passkey", "run_perplexity",
]
