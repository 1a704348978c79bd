"""The next token of every sequence that produced logits this step.

Greedy rows take the argmax of all rows in one call (ties go to the lowest id, as ``torch.argmax``
and ``model.generate`` do). Sampled rows apply temperature, top-k and top-p together on the batch
and then draw each row with its own generator: a request with a ``seed`` draws the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import torch

from kvfactory.engine.request import Request


class Sampler:
    """Draws next tokens; keeps one generator per seeded request until ``forget``."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator()
        self._shared.seed()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """``logits [len(requests), vocab]`` (any float dtype) to one token id per request."""
        tokens = logits.argmax(-1)
        sampled = [i for i, request in enumerate(requests) if not request.params.greedy]
        if sampled:
            rows = torch.tensor(sampled)
            probs = self._probabilities(logits[rows].float(), [requests[i].params for i in sampled])
            for row, i in enumerate(sampled):
                generator = self._generator(requests[i])
                tokens[i] = torch.multinomial(probs[row], 1, generator=generator)[0]
        return tokens.tolist()

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        if request.params.seed is None:
            return self._shared
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = self._generators[request.request_id] = torch.Generator()
            generator.manual_seed(request.params.seed)
        return generator

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temperature[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        ordered, order = logits.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = ordered.softmax(-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)[:, None]
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens: keep while it is below top_p
        probs = probs.masked_fill(before >= top_p, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, probs).cpu()  # drawn with CPU generators
