"""``kvfactory oval train``: distil a model's full attention into an OVAL router.

1. **Teacher.** ``kvfactory.selectors.teacher`` runs chunks of ``chunk`` tokens through the frozen
   model with full attention and records, at ``positions`` sampled query positions per chunk, each
   16-token page's attention mass, Quest's score, the page summaries and the decoder's last hidden
   state before the position (what the router sees when decoding the token there).
2. **Training.** The router's logits over the candidate pages (after the sink page, before the
   current one, which are always read) are fitted to the teacher's mass with KL divergence plus a
   focal loss on membership of the teacher's top-k at the read budget; the LM stays frozen.
3. **Report.** On held-out text: hit rate and attention-mass recall at the read budget of the
   router, Quest, recent pages and the oracle (the teacher's own top-k), per epoch.

Train on the Gutenberg books in ``shared/data``, never on the evaluation text (WikiText).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfactory.selectors.oval.router import Router, RouterShape
from kvfactory.selectors.teacher import Chunk, candidates, cap, chosen_count, collect, tokens_of


def router_logits(router: Router, chunk: Chunk, decay: bool = True) -> torch.Tensor:
    """``[S, L, Hkv, P]``: the router's page logits for every sampled position and layer."""
    vectors = router.key_vectors(chunk.hidden)  # [S, G, Hkv, F]
    groups = torch.tensor([router.shape.group_of(layer) for layer in router.shape.layers])
    content = torch.einsum("slhf,lhpf->slhp", vectors[:, groups], chunk.features.float())
    if not decay:
        return content
    distance = (chunk.current[:, None] - torch.arange(chunk.features.shape[2])).float()
    return content + router.decay_bonus(distance)[:, None, None, :]


def loss(router: Router, chunk: Chunk, budget: float, focal_weight: float = 1.0, gamma: float = 2.0
         ) -> torch.Tensor:
    """KL(teacher mass || router softmax) over the candidates, plus a focal loss on top-k membership."""
    logits = router_logits(router, chunk)
    allowed = candidates(chunk.current, logits.shape[-1])[:, None, None, :]
    mass = chunk.mass.float().masked_fill(~allowed, 0)
    target = mass / mass.sum(-1, keepdim=True).clamp(min=1e-9)
    log_probs = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    kl = torch.where(allowed & (target > 0), target * (target.clamp(min=1e-9).log() - log_probs), 0).sum(-1)
    k = chosen_count(chunk.current, budget)
    rank = mass.argsort(-1, descending=True).argsort(-1)  # 0 = most mass
    member = (rank < k[:, None, None, None]) & allowed
    p = torch.sigmoid(logits)
    p_true = torch.where(member, p, 1 - p)
    focal = torch.where(allowed, -(1 - p_true) ** gamma * p_true.clamp(min=1e-9).log(), 0)
    return kl.mean() + focal_weight * focal.sum(-1).mean() / allowed.sum(-1).clamp(min=1).float().mean()


@torch.no_grad()
def evaluate(router: Router, chunks: Sequence[Chunk], budget: float, ablations: bool = False,
             ) -> dict[str, dict[str, float]]:
    """Hit rate and mass recall at ``budget`` per method, as the cache measures them (the sink and
    current page always read), mean over positions, layers and KV heads. ``ablations`` adds the
    router without its positional decay, the random baseline and ``oracle_pooled``: the oracle
    free to move the budget between the layers and KV heads of a position (the best any per-step
    allocation could read)."""
    totals: dict[str, list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    for chunk in chunks:
        pages = chunk.features.shape[2]
        allowed = candidates(chunk.current, pages)[:, None, None, :].expand(chunk.mass.shape)
        mass = chunk.mass.float()
        k = chosen_count(chunk.current, budget)
        ranked = {"router": router_logits(router, chunk), "quest": chunk.quest.float(),
                  "recent": torch.arange(pages, dtype=torch.float32).expand_as(mass), "oracle": mass}
        if ablations:
            ranked |= {"router_no_decay": router_logits(router, chunk, decay=False),
                       "random": torch.rand(mass.shape, generator=gen)}
        forced = torch.zeros(mass.shape, dtype=torch.bool)
        forced[..., 0] = True
        forced.scatter_(-1, chunk.current[:, None, None, None].expand(*mass.shape[:3], 1), True)
        reads = {name: _top(scores, allowed, k[:, None, None, None]) | forced
                 for name, scores in ranked.items()}
        if ablations:
            pooled = (k * mass.shape[1] * mass.shape[2])[:, None]
            reads["oracle_pooled"] = _top(mass.flatten(1), allowed.flatten(1), pooled).view_as(mass) | forced
        truth_rank = mass.argsort(-1, descending=True).argsort(-1)
        for name, read in reads.items():
            total = read.sum(-1)
            recall = (mass * read).sum(-1)
            hit = ((truth_rank < total[..., None]) & read).sum(-1).float() / total
            stats = totals.setdefault(name, [0.0, 0.0, 0.0])
            stats[0] += float(recall.sum())
            stats[1] += float(hit.sum())
            stats[2] += recall.numel()
    return {name: {"recall": s[0] / s[2], "hit_rate": s[1] / s[2]} for name, s in totals.items()}


def _top(scores: torch.Tensor, allowed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Where ``scores`` ranks among the ``count`` highest of the ``allowed`` entries of its last dim."""
    rank = scores.masked_fill(~allowed, float("-inf")).argsort(-1, descending=True).argsort(-1)
    return (rank < count) & allowed


def train(router: Router, chunks: Sequence[Chunk], epochs: int, budget: float, lr: float = 3e-3,
          seed: int = 0, on_epoch: Callable[[int, float], None] = lambda epoch, loss: None) -> None:
    """Adam over the chunks, one chunk (all its positions) per step, shuffled each epoch."""
    gen = random.Random(seed)
    optimizer = torch.optim.Adam(router.parameters(), lr=lr)
    order = list(range(len(chunks)))
    router.train()
    for epoch in range(epochs):
        gen.shuffle(order)
        total = 0.0
        for i in order:
            optimizer.zero_grad()
            value = loss(router, chunks[i], budget)
            value.backward()
            optimizer.step()
            total += value.item()
        on_epoch(epoch, total / max(len(order), 1))
    router.eval()


def new_router(model: Any, dense_layers: int, name: str) -> Router:
    """An untrained router for ``model``'s full-attention layers after the first ``dense_layers``."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = tuple(range(dense_layers, config.num_hidden_layers))
    torch.manual_seed(0)
    return Router(RouterShape(config.hidden_size, config.num_key_value_heads, head_dim, layers, model=name))


def fit_summary(report: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{name} recall {v['recall']:.3f} hit {v['hit_rate']:.3f}" for name, v in report.items())


def learning_curve_points(epochs: int) -> set[int]:
    """Epochs after which held-out metrics are printed (about eight, and the last)."""
    return {e for e in range(epochs) if e % max(1, math.ceil(epochs / 8)) == 0} | {epochs - 1}



def run(model: Any, tokenizer: Any, train_texts: Sequence[str], val_texts: Sequence[str], out: str,
        name: str, dense_layers: int = 2, chunk: int = 2048, positions: int = 32, train_chunks: int = 48,
        val_chunks: int = 12, epochs: int = 40, budget: float = 0.125,
        console: Any = None) -> dict[str, Any]:
    """Collect, train, evaluate per epoch on held-out text, save to ``out``; returns the report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    router = new_router(model, dense_layers, name)
    layers = router.shape.layers
    train_ids = cap(tokens_of(tokenizer, train_texts), train_chunks, chunk)
    val_ids = cap(tokens_of(tokenizer, val_texts), val_chunks, chunk)
    curve: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("teacher: full attention on the training text",
                                 total=train_ids.numel() // chunk)
        train_set = collect(model, train_ids, layers, positions, chunk, 0, lambda: progress.advance(task))
        task = progress.add_task("teacher: held-out text", total=val_ids.numel() // chunk)
        val_set = collect(model, val_ids, layers, positions, chunk, 1, lambda: progress.advance(task))
        task = progress.add_task("training the router", total=epochs)
        points = learning_curve_points(epochs)

        def on_epoch(epoch: int, value: float) -> None:
            progress.advance(task)
            if epoch in points:
                held_out = evaluate(router, val_set, budget)
                curve.append({"epoch": epoch + 1, "loss": value} | held_out)
                progress.console.print(f"epoch {epoch + 1}: loss {value:.4f}; held-out at read budget "
                                       f"{budget:g}: {fit_summary(held_out)}")

        train(router, train_set, epochs, budget, on_epoch=on_epoch)
    router.save(out)
    return {"router": str(out), "model": name, "layers": list(layers), "budget": budget, "chunk": chunk,
            "positions": positions, "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(),
            "epochs": epochs, "curve": curve}
