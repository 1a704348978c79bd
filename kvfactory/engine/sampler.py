"""The next token of every sequence that produced logits this step.

Greedy rows take the argmax of all rows in one call (ties go to the lowest id, as ``torch.argmax``
and ``model.generate`` do). Sampled rows apply temperature, top-k and top-p together on the batch
and then draw each row with its own generator: a request with a ``seed`` draws the same tokens
whatever else shares its batch.

A row that cannot give a token (logits with a NaN or +inf, or all -inf; a draw that fails) fails
its own request only: ``Sampled.failures`` names the cause, and every other row's token is the one
it would have been anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvfactory.engine.request import Request


@dataclass
class Sampled:
    """One step's draws: ``tokens[i]`` for ``requests[i]``, None where ``failures[i]`` says why not."""

    tokens: list[int | None]
    failures: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Draws next tokens; keeps one generator per seeded request until ``forget``."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator()
        self._shared.seed()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        """``logits [len(requests), vocab]`` (any float dtype) to one token id per request."""
        top, greedy = logits.max(-1)  # one pass: the largest is NaN, +inf or -inf when a row has none
        failures = {int(i): "its logits are not finite (NaN, +inf, or -inf everywhere)"
                    for i in (~top.isfinite()).nonzero().flatten().tolist()}
        tokens: list[int | None] = greedy.tolist()
        sampled = [i for i, request in enumerate(requests) if not request.params.greedy and i not in failures]
        if sampled:
            rows = torch.tensor(sampled)
            probs = self._probabilities(logits[rows].float(), [requests[i].params for i in sampled])
            for row, i in enumerate(sampled):
                try:
                    generator = self._generator(requests[i])
                    tokens[i] = int(torch.multinomial(probs[row], 1, generator=generator)[0])
                except Exception as exc:  # an invalid distribution, a seed torch refuses: this row only
                    failures[i] = f"sampling failed: {exc}"
        for i in failures:
            tokens[i] = None
        return Sampled(tokens, failures)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        if request.params.seed is None:
            return self._shared
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(request.params.seed)
            self._generators[request.request_id] = generator
        return generator

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list) -> torch.Tensor:
        """Each row's distribution after temperature, top-k and top-p. The row's largest logit is
        subtracted before dividing, so any temperature that is a positive float32 gives finite
        values (the largest is 0, the others at most 0)."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = (logits - logits.amax(-1, keepdim=True)) / temperature[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        ordered, order = logits.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = ordered.softmax(-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)[:, None]
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens: keep while it is below top_p
        probs = probs.masked_fill((before >= top_p) & (ranks > 0), 0.0)  # the most likely always stays
        return torch.zeros_like(probs).scatter_(-1, order, probs).cpu()  # drawn with CPU generators
