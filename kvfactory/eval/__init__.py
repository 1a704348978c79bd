"""Evaluation of caches on the embedded model: perplexity through the cache, passkey, needle in a
haystack and multi-turn recall, per the measurement protocol of docs/evaluation.md.

``data`` loads WikiText-2 test and builds deterministic prompts, ``scoring`` holds the pure
scorers, ``tasks`` runs prompts through caches, ``footprint`` measures what a cache holds and
``settings`` sizes a run (and documents where its defaults deviate from the protocol).
"""
