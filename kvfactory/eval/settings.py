"""Sample sizes of an evaluation run: the defaults, sized to a time budget, and the measurement protocol.

The budget: a full default run (passkey, needle and multiturn at 2048 and 6144 tokens, ppl at
2048, for one config plus the ``DynamicCache`` baseline) on this project's 2-core CPU machine,
SmolLM2-135M in fp32 on one thread. Prefill dominates retrieval: every prompt is prefilled through
a fresh cache (a compressing cache must see each prompt whole, so prompts that share a prefix
cannot share a prefill), about 10 s at 2048 tokens and 45 s at 6144; perplexity is dominated by
its 512 teacher-forced steps per window. Measured seconds per item (CPU time of
``kvfactory.eval.tasks`` on this machine, 1 thread; the machine was shared while measuring, which
made wall times 1.3-2x longer than these):

| item                                                    | 2048 | 6144 |
|---------------------------------------------------------|------|------|
| passkey prompt (prefill + 10 tokens)                    | 12.8 | 47.5 |
| needle prompt (prefill + up to 24 tokens)               | 13.0 | 51.2 |
| multi-turn conversation (prefill + 5 short replies)     | 12.8 | 57.5 |
| perplexity window (prefill + 512 teacher-forced steps)  | 33.5 |  –   |

Perplexity settles a claim only over several windows (the protocol: at least 4 x 512 scored tokens
from different parts of the text, ΔPPL with a paired confidence interval), so the defaults score 4
windows of 512 tokens, one in each quarter of the text, after 2048 tokens of context. With ``n``
prompts per retrieval task and context (depths x samples), one config costs
``(12.8 + 13.0) n + 12.8`` s at 2048 and ``(47.5 + 51.2) n + 57.5`` s at 6144 for retrieval,
plus ``4 x 33.5 = 134`` s of perplexity, and a run twice that (the baseline runs every task too):

- ``n = 2`` (the defaults): 2 x (319 + 134) = 906 s, about 15 minutes, plus model load and
  warm-up; 88 s more than when perplexity was one window of 128 tokens at each context (2 x 409 s;
  ``kvfactory eval --cache paged16`` took 822.5 s on 2026-11-29). The perplexity window was timed
  on 2026-12-01 (DynamicCache, WikiText, 6.4 s prefill and 27.6 s for the 512 steps); configs
  differ: in one run of 13 configs, int4 took 0.49x DynamicCache's wall time per window, int8
  0.72x, fp8 1.07x, the eviction policies at 0.5 0.53-0.71x, transformers' quanto int4 0.95-0.98x.
- perplexity at 6144 too (the protocol's second context, ``--ppl-context 2048,6144``) adds 4
  windows of about 45 s of prefill and 512 steps of about 0.2 s each, about 590 s per config:
  about 20 more minutes a run.
- ``n = 3`` (depths 0.1, 0.5, 0.9) adds 2 x 124.5 s, about 4 minutes.
- the protocol (25 passkey and 25 needle prompts per context, ppl at both contexts): about
  3,900 s per config, over two hours a run.

So the defaults deviate from the protocol in: depths (0.1, 0.9), not (0.1, 0.3, 0.5, 0.7,
0.9); one key (and one haystack) per depth, not five; perplexity at 2048 only, not also 6144.
``PROTOCOL`` holds the protocol's numbers. Retrieval answers of the baseline are a pure function
of the prompts: a runner comparing several configs runs the baseline once for all.
"""

from __future__ import annotations

from dataclasses import dataclass

# The protocol scores prefill compression in both settings: the question "inside" the prompt a cache
# compresses (query-aware), or fed "after" the context was compressed (kvpress's pipeline).
QUESTION_SETTINGS = ("inside", "after")


@dataclass(frozen=True)
class EvalSettings:
    """How many samples each task draws, per context length."""

    contexts: tuple[int, ...] = (2048, 6144)
    depths: tuple[float, ...] = (0.1, 0.9)
    keys_per_depth: int = 1
    needles_per_depth: int = 1
    ppl_continuation: int = 512
    ppl_windows: int = 4
    ppl_contexts: tuple[int, ...] | None = None  # where ppl runs; None: every context of ``contexts``
    facts: int = 5
    conversations: int = 1
    seed: int = 0
    question: str = "inside"  # retrieval: "inside" the compressed prefill, or fed "after" it (kvpress's)

    def __post_init__(self) -> None:
        counts = {"keys_per_depth": self.keys_per_depth, "needles_per_depth": self.needles_per_depth,
                  "ppl_continuation": self.ppl_continuation, "ppl_windows": self.ppl_windows,
                  "facts": self.facts, "conversations": self.conversations}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name}={value}: expected at least 1")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"contexts={self.contexts}: expected positive token counts")
        if self.ppl_contexts is not None and (not self.ppl_contexts or min(self.ppl_contexts) < 1):
            raise ValueError(f"ppl_contexts={self.ppl_contexts}: expected positive token counts or None")
        if self.question not in QUESTION_SETTINGS:
            raise ValueError(f"question={self.question!r}: expected one of {', '.join(QUESTION_SETTINGS)}")
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths={self.depths}: expected fractions in [0, 1]")


    def task_contexts(self, task: str) -> tuple[int, ...]:
        """The context lengths ``task`` runs at: ``ppl_contexts`` for ppl (unless None), else ``contexts``."""
        if task == "ppl" and self.ppl_contexts is not None:
            return tuple(self.ppl_contexts)
        return tuple(self.contexts)

    def all_contexts(self, tasks: tuple[str, ...] | list[str]) -> tuple[int, ...]:
        """Every context length some task of ``tasks`` runs at, in order of first appearance."""
        return tuple(dict.fromkeys(c for c in (*self.contexts, *(self.ppl_contexts or ()))
                                   if any(c in self.task_contexts(t) for t in tasks)))


DEFAULT = EvalSettings(ppl_contexts=(2048,))
PROTOCOL = EvalSettings(depths=(0.1, 0.3, 0.5, 0.7, 0.9), keys_per_depth=5, needles_per_depth=5,
                        ppl_continuation=512, ppl_windows=4, ppl_contexts=None)
