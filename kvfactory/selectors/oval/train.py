"""``kvfactory oval train``: distil a model's full attention into an OVAL scorer of either kind.

1. **Teacher.** ``kvfactory.selectors.teacher`` runs chunks of ``chunk`` tokens through the frozen
   model with full attention and records, at ``positions`` sampled query positions per chunk, each
   16-token page's attention mass, Quest's score, the page summaries and the decoder's last hidden
   state before the position (what the prefetch router sees when decoding the token there); for the
   query scorer also the keys and the sampled queries.
2. **Training.** Over the candidate pages (after the sink page, before the current one, which are
   always read), fitted to the teacher's ``objective`` (``OBJECTIVES``), the LM frozen: each page's
   attention mass, or its pull on the attention output (``teacher.page_impact``: what the step's
   output loses when the page is not read). The query scorer (``lowrank.LowRankScorer``) starts
   from each layer's principal key directions and fits its projections so its estimated page shares
   match the target's (KL divergence, a listwise ranking loss); its int8 code scales are then set
   from the training keys. The prefetch router (``router.Router``) fits its logits with KL
   divergence plus a focal loss on membership of the target's top-k at the read budget.
3. **Report.** On held-out text: hit rate and attention-mass recall at the read budget of the
   scorer, Quest, recent pages and the oracle (the teacher's own top-k), per epoch.
4. **Per-layer mix** (``mix``). Each routed layer is handed to Quest or recent pages where, on the
   held-out text, reading their pages gives a lower attention-output error than the scorer's
   (``choose_layers``); the choice is saved with the router (``files.py``).

Train on the Gutenberg books in ``shared/data``, never on the evaluation text (WikiText).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfactory.cache import attention_layout
from kvfactory.selectors.oval.files import MIXED, load_module
from kvfactory.selectors.oval.gate import BlockGate, GateShape
from kvfactory.selectors.oval.lowrank import LowRankScorer, LowRankShape
from kvfactory.selectors.oval.router import Router, RouterShape
from kvfactory.selectors.teacher import PAGE, Chunk, candidates, cap, chosen_count, collect, tokens_of

Scorer = Router | LowRankScorer | BlockGate


def router_logits(router: Router, chunk: Chunk, decay: bool = True) -> torch.Tensor:
    """``[S, L, Hkv, P]``: the router's page logits for every sampled position and layer."""
    vectors = router.key_vectors(chunk.hidden)  # [S, G, Hkv, F]
    groups = torch.tensor([router.shape.group_of(layer) for layer in chunk.layers])
    content = torch.einsum("slhf,lhpf->slhp", vectors[:, groups], chunk.features.float())
    if not decay:
        return content
    distance = (chunk.current[:, None] - torch.arange(chunk.features.shape[2])).float()
    return content + router.decay_bonus(distance)[:, None, None, :]


def query_shares(scorer: LowRankScorer, chunk: Chunk, quantized: bool = False) -> torch.Tensor:
    """``[S, L, Hkv, P]``: the query scorer's estimated page shares at every sampled position and layer
    of ``chunk`` (layers the scorer covers), from float projections of the keys (training) or from
    their int8 codes (as decode reads them)."""
    shape = scorer.shape
    s, hkv, pages = chunk.queries.shape[0], shape.kv_heads, chunk.keys.shape[2] // PAGE
    causal = torch.arange(pages * PAGE) > chunk.positions[:, None]  # [S, T]
    shares = []
    for at, layer in enumerate(chunk.layers):
        keys = chunk.keys[at][None].float()  # [1, Hkv, T, D]
        own = shape.index_of(layer)
        if quantized:
            projected = scorer.encode(keys, layer).float() * scorer.code_scale[own, :, None]
        else:
            projected = keys @ scorer.key[own]
        queries = chunk.queries[:, at].float().view(s, hkv, scorer.group, 1, -1)
        logits = scorer.token_logits(queries, projected, layer)[:, :, :, 0]  # [S, Hkv, G, T]
        probs = logits.masked_fill(causal[:, None, None], float("-inf")).softmax(-1).mean(2)
        shares.append(probs.view(s, hkv, pages, PAGE).sum(-1))
    return torch.stack(shares, 1)


OBJECTIVES = ("mass", "output")  # what a scorer is fitted to: page mass, or page impact on the output


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: one of {OBJECTIVES}")


def check_dim(dim: int | None, kind: str) -> None:
    """``dim`` sizes a gate's page embedding: no other router kind takes it."""
    if dim is not None and kind != "gate":
        raise ValueError(f"dim={dim} sizes a gate's page embedding; a {kind} router has none")


def target_of(chunk: Chunk, objective: str) -> torch.Tensor:
    """``[S, L, Hkv, P]``: the teacher's per-page target for ``objective`` (``OBJECTIVES``)."""
    check_objective(objective)
    if objective == "output" and chunk.impact is None:
        raise ValueError("objective 'output' fits each page's impact: collect the chunks with impact=True")
    return chunk.mass if objective == "mass" else chunk.impact


def _shares(chunk: Chunk, objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate pages ``[S, 1, 1, P]`` and the teacher's target over them as shares."""
    allowed = candidates(chunk.current, chunk.mass.shape[-1])[:, None, None, :]
    target = target_of(chunk, objective).float().masked_fill(~allowed, 0)
    return allowed, target / target.sum(-1, keepdim=True).clamp(min=1e-9)


def _kl(target: torch.Tensor, log_probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``[S, L, Hkv]``: KL(target || probs) over the allowed pages (a listwise ranking loss)."""
    inside = allowed & (target > 0)
    return torch.where(inside, target * (target.clamp(min=1e-9).log() - log_probs), 0).sum(-1)


def query_loss(scorer: LowRankScorer, chunk: Chunk, objective: str = "mass") -> torch.Tensor:
    """KL(teacher target || estimated shares), both over the candidate pages."""
    allowed, target = _shares(chunk, objective)
    estimate = query_shares(scorer, chunk).masked_fill(~allowed, 0)
    estimate = estimate / estimate.sum(-1, keepdim=True).clamp(min=1e-12)
    return _kl(target, estimate.clamp(min=1e-12).log(), allowed).mean()


def gate_logits(gate: BlockGate, chunk: Chunk) -> torch.Tensor:
    """``[S, L, Hkv, P]``: the gate's page logits at every sampled position and layer of ``chunk``."""
    s, hkv = chunk.queries.shape[0], gate.shape.kv_heads
    logits = []
    for at, layer in enumerate(chunk.layers):
        embedded = gate.embed_pages(chunk.features[at][None].float(), layer)  # [1, Hkv, P, E]
        queries = chunk.queries[:, at].float().view(s, hkv, gate.group, -1)  # one new token per position
        logits.append(gate.page_logits(queries, embedded.expand(s, -1, -1, -1), layer))
    return torch.stack(logits, 1)


def gate_loss(gate: BlockGate, chunk: Chunk, objective: str = "mass") -> torch.Tensor:
    """KL(teacher target || gate softmax), both over the candidate pages."""
    allowed, target = _shares(chunk, objective)
    return _kl(target, gate_logits(gate, chunk).masked_fill(~allowed, float("-inf")).log_softmax(-1),
               allowed).mean()


def loss(router: Router, chunk: Chunk, budget: float, focal_weight: float = 1.0, gamma: float = 2.0,
         objective: str = "mass") -> torch.Tensor:
    """KL(teacher target || router softmax) over the candidates, plus a focal loss on top-k membership."""
    logits = router_logits(router, chunk)
    allowed, target = _shares(chunk, objective)
    kl = _kl(target, logits.masked_fill(~allowed, float("-inf")).log_softmax(-1), allowed)
    k = chosen_count(chunk.current, budget)
    rank = target.argsort(-1, descending=True).argsort(-1)  # 0 = the most of the target
    member = (rank < k[:, None, None, None]) & allowed
    p = torch.sigmoid(logits)
    p_true = torch.where(member, p, 1 - p)
    focal = torch.where(allowed, -(1 - p_true) ** gamma * p_true.clamp(min=1e-9).log(), 0)
    return kl.mean() + focal_weight * focal.sum(-1).mean() / allowed.sum(-1).clamp(min=1).float().mean()


# per scorer kind: its training loss (scorer, chunk, budget, objective) and its ranking as decode's
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "query": lambda scorer, chunk, budget, objective: query_loss(scorer, chunk, objective),
    "gate": lambda scorer, chunk, budget, objective: gate_loss(scorer, chunk, objective),
    "prefetch": lambda scorer, chunk, budget, objective: loss(scorer, chunk, budget, objective=objective)}
RANKINGS: dict[str, Callable[..., torch.Tensor]] = {
    "query": lambda scorer, chunk: query_shares(scorer, chunk, quantized=True),
    "gate": gate_logits, "prefetch": router_logits}


def ranking(scorer: Scorer, chunk: Chunk) -> torch.Tensor:
    """``[S, L, Hkv, P]``: how ``scorer`` ranks the pages, as decode would (query scorer: int8 codes)."""
    return RANKINGS[scorer.kind](scorer, chunk)


@torch.no_grad()
def evaluate(router: Scorer, chunks: Sequence[Chunk], budget: float, ablations: bool = False,
             others: dict[str, Scorer] | None = None, detail: bool = False) -> dict[str, dict[str, Any]]:
    """Hit rate and mass recall at ``budget`` per method, as the cache measures them (the sink and
    current page always read), mean over positions, layers and KV heads: ``router`` (either kind),
    ``others`` by their names, Quest, recent pages and the oracle. ``ablations`` adds a prefetch
    router without its positional decay, the random baseline and ``oracle_pooled``: the oracle
    free to move the budget between the layers and KV heads of a position (the best any per-step
    allocation could read). ``detail`` adds the tail of each method's recall over (position, layer,
    KV head): its 1st and 5th percentiles, the share under one half, and the mean per layer; for
    chunks with values (``collect(values=True)``) also the attention output's relative error
    (``output_errors``), mean and per layer."""
    totals: dict[str, list[float]] = {}
    recalls: dict[str, list[torch.Tensor]] = {}
    errors: dict[str, list[torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(0)
    for chunk in chunks:
        pages = chunk.features.shape[2]
        allowed = candidates(chunk.current, pages)[:, None, None, :].expand(chunk.mass.shape)
        mass = chunk.mass.float()
        k = chosen_count(chunk.current, budget)
        ranked = {"router": ranking(router, chunk), "quest": chunk.quest.float(),
                  "recent": torch.arange(pages, dtype=torch.float32).expand_as(mass), "oracle": mass}
        ranked |= {name: ranking(other, chunk) for name, other in (others or {}).items()}
        if ablations:
            if isinstance(router, Router):
                ranked["router_no_decay"] = router_logits(router, chunk, decay=False)
            ranked["random"] = torch.rand(mass.shape, generator=gen)
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
            if detail:
                recalls.setdefault(name, []).append(recall.float())
        if detail and chunk.values is not None:
            for name, error in output_errors(chunk, reads).items():
                errors.setdefault(name, []).append(error)
    report: dict[str, dict[str, Any]] = {name: {"recall": s[0] / s[2], "hit_rate": s[1] / s[2]}
                                         for name, s in totals.items()}
    for name, parts in recalls.items():
        recall = torch.cat(parts)  # [positions, layers, KV heads]
        report[name] |= {"recall_p01": float(recall.quantile(0.01)),
                         "recall_p05": float(recall.quantile(0.05)),
                         "under_half": float((recall < 0.5).float().mean()),
                         "per_layer": dict(zip(chunks[0].layers, recall.mean((0, 2)).tolist(), strict=True))}
    for name, parts in errors.items():
        error = torch.cat(parts)  # [positions, layers, query heads]
        report[name] |= {"output_error": float(error.mean()),
                         "output_error_per_layer": dict(zip(chunks[0].layers, error.mean((0, 2)).tolist(),
                                                            strict=True))}
    return report


def output_errors(chunk: Chunk, reads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per method, ``[S, L, Hq]``: the relative error ``|o_read - o| / |o|`` of each query head's
    attention output at each sampled position and layer when it attends only to the pages ``reads``
    marks (``[S, L, Hkv, P]``, renormalised over them) against full attention's ``o``. The inputs are
    full attention's at every layer, so errors do not compound here as they do in decode."""
    s, layers = chunk.queries.shape[:2]
    hkv, tokens, d = chunk.keys.shape[1:]
    causal = torch.arange(tokens) > chunk.positions[:, None]  # [S, T]
    out: dict[str, list[torch.Tensor]] = {name: [] for name in reads}
    for at in range(layers):
        q = chunk.queries[:, at].float().view(s, hkv, -1, d).transpose(0, 1)  # [Hkv, S, G, D]
        keys, values = chunk.keys[at].float(), chunk.values[at].float()  # [Hkv, T, D]
        probs = (q @ keys[:, None].transpose(-1, -2) * chunk.scaling).masked_fill(
            causal[None, :, None], float("-inf")).softmax(-1)  # [Hkv, S, G, T]
        full = probs @ values[:, None]  # [Hkv, S, G, D]
        for name, read in reads.items():
            tokens_read = read[:, at].transpose(0, 1).repeat_interleave(PAGE, -1)[:, :, None, :]
            kept = probs * tokens_read  # [Hkv, S, G, T]
            partial = kept @ values[:, None] / kept.sum(-1, keepdim=True).clamp(min=1e-12)
            error = (partial - full).norm(dim=-1) / full.norm(dim=-1).clamp(min=1e-9)  # [Hkv, S, G]
            out[name].append(error.permute(1, 0, 2).flatten(1))  # [S, Hq]
    return {name: torch.stack(parts, 1) for name, parts in out.items()}


def _top(scores: torch.Tensor, allowed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Where ``scores`` ranks among the ``count`` highest of the ``allowed`` entries of its last dim."""
    rank = scores.masked_fill(~allowed, float("-inf")).argsort(-1, descending=True).argsort(-1)
    return (rank < count) & allowed


LEARNING_RATES = {"query": 1e-2, "prefetch": 3e-3, "gate": 3e-3}
EPOCHS = {"query": 8, "prefetch": 40, "gate": 12}  # the query scorer has 2 x rank x head_dim weights per head


def train(router: Scorer, chunks: Sequence[Chunk], epochs: int, budget: float, lr: float | None = None,
          seed: int = 0, on_epoch: Callable[[int, float], None] = lambda epoch, loss: None,
          objective: str = "mass") -> None:
    """Adam over the chunks, one chunk (all its positions) per step, shuffled each epoch; a query
    scorer or a gate starts from the chunks' principal key directions, a query scorer gets its code
    scales at the end."""
    gen = random.Random(seed)
    if hasattr(router, "init_from_keys"):
        router.init_from_keys(_sample_keys(chunks))
    optimizer = torch.optim.Adam(router.parameters(), lr=lr or LEARNING_RATES[router.kind])
    order = list(range(len(chunks)))
    router.train()
    for epoch in range(epochs):
        gen.shuffle(order)
        total = 0.0
        for i in order:
            optimizer.zero_grad()
            value = LOSSES[router.kind](router, chunks[i], budget, objective)
            value.backward()
            optimizer.step()
            total += value.item()
        if hasattr(router, "fit_code_scales"):
            router.fit_code_scales(_sample_keys(chunks))
        on_epoch(epoch, total / max(len(order), 1))
    router.eval()


def _sample_keys(chunks: Sequence[Chunk], count: int = 4) -> torch.Tensor:
    """The keys of up to ``count`` chunks spread over the training set, ``[L, Hkv, T, D]``."""
    step = max(1, len(chunks) // count)
    return torch.cat([chunk.keys for chunk in chunks[::step][:count]], 2)


def new_router(model: Any, dense_layers: int, name: str, kind: str = "prefetch", dim: int | None = None
               ) -> Scorer:
    """An untrained scorer of ``kind`` (``"query"``, ``"gate"`` or ``"prefetch"``) for ``model``'s
    full-attention layers after the first ``dense_layers`` (sliding-window layers are never read
    sparsely); ``dim``: a gate's numbers per page embedding (default ``GateShape.dim``)."""
    check_dim(dim, kind)
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    windows = attention_layout(model.config)
    layers = tuple(i for i in range(dense_layers, config.num_hidden_layers) if windows[i] is None)
    torch.manual_seed(0)
    if kind == "query":
        return LowRankScorer(LowRankShape(heads, config.num_key_value_heads, head_dim, layers, model=name))
    if kind == "gate":
        return BlockGate(GateShape(heads, config.num_key_value_heads, head_dim, layers,
                                   dim=dim or GateShape.dim, model=name))
    return Router(RouterShape(config.hidden_size, config.num_key_value_heads, head_dim, layers, model=name))


def choose_layers(report: dict[str, dict[str, Any]]) -> dict[int, str]:
    """From ``evaluate(detail=True)`` on chunks with values: the layers where Quest's or recent pages'
    attention-output error is below the scorer's (``"router"``), each to the lower of the two."""
    errors = {name: report[name]["output_error_per_layer"] for name in ("router", *MIXED)}
    chosen = {layer: min(errors, key=lambda name: errors[name][layer]) for layer in errors["router"]}
    return {layer: name for layer, name in chosen.items() if name != "router"}


def fit_summary(report: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{name} recall {v['recall']:.3f} hit {v['hit_rate']:.3f}" for name, v in report.items())


def learning_curve_points(epochs: int) -> set[int]:
    """Epochs after which held-out metrics are printed (about eight, and the last)."""
    return {e for e in range(epochs) if e % max(1, math.ceil(epochs / 8)) == 0} | {epochs - 1}


def run(model: Any, tokenizer: Any, train_texts: Sequence[str], val_texts: Sequence[str], out: str,
        name: str, dense_layers: int = 2, chunk: int = 2048, positions: int = 32, train_chunks: int = 48,
        val_chunks: int = 12, epochs: int | None = None, budget: float = 0.125,
        console: Any = None, kind: str = "query", objective: str = "mass", mix: bool = True,
        dim: int | None = None) -> dict[str, Any]:
    """Collect, train, evaluate per epoch on held-out text, choose the per-layer mix there (``mix``),
    save to ``out``; returns the report."""
    check_objective(objective)  # before any work
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    router = new_router(model, dense_layers, name, kind, dim)
    keys, epochs = kind in ("query", "gate"), epochs or EPOCHS[kind]
    layers = router.shape.layers
    train_ids = cap(tokens_of(tokenizer, train_texts), train_chunks, chunk)
    val_ids = cap(tokens_of(tokenizer, val_texts), val_chunks, chunk)
    curve: list[dict[str, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("teacher: full attention on the training text",
                                 total=train_ids.numel() // chunk)
        train_set = collect(model, train_ids, layers, positions, chunk, 0, lambda: progress.advance(task),
                            keys, impact=objective == "output")
        task = progress.add_task("teacher: held-out text", total=val_ids.numel() // chunk)
        val_set = collect(model, val_ids, layers, positions, chunk, 1, lambda: progress.advance(task),
                          keys or mix, values=mix)
        task = progress.add_task("training the router", total=epochs)
        points = learning_curve_points(epochs)

        def on_epoch(epoch: int, value: float) -> None:
            progress.advance(task)
            if epoch in points:
                held_out = evaluate(router, val_set, budget)
                curve.append({"epoch": epoch + 1, "loss": value} | held_out)
                progress.console.print(f"epoch {epoch + 1}: loss {value:.4f}; held-out at read budget "
                                       f"{budget:g}: {fit_summary(held_out)}")

        train(router, train_set, epochs, budget, on_epoch=on_epoch, objective=objective)
    errors = choose_mix(router, val_set, budget) if mix else None
    router.save(out)
    return {"router": str(out), "kind": kind, "model": name, "layers": list(layers), "budget": budget,
            "chunk": chunk,
            "positions": positions, "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(),
            "epochs": epochs, "objective": objective, "curve": curve,
            "layer_selectors": router.layer_selectors,
            "output_error_per_layer": errors}


def choose_mix(router: Scorer, chunks: Sequence[Chunk], budget: float) -> dict[str, dict[int, float]]:
    """Set ``router.layer_selectors`` from held-out ``chunks`` with values (``choose_layers``); returns
    the per-layer output errors it chose by, the oracle's too."""
    detail = evaluate(router, chunks, budget, detail=True)
    router.layer_selectors = choose_layers(detail)
    return {name: detail[name]["output_error_per_layer"] for name in ("router", *MIXED, "oracle")}


def mix_router(model: Any, tokenizer: Any, path: str, val_texts: Sequence[str], chunk: int = 2048,
        positions: int = 32, val_chunks: int = 12, budget: float = 0.125,
        advance: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Choose the per-layer mix of the router in ``path`` on held-out text and save it there."""
    router = load_module(path)
    ids = cap(tokens_of(tokenizer, val_texts), val_chunks, chunk)
    chunks = collect(model, ids, router.shape.layers, positions, chunk, 1, advance, keys=True, values=True)
    errors = choose_mix(router, chunks, budget)
    router.save(path)
    return {"router": path, "chunk": chunk, "val_tokens": ids.numel(), "budget": budget,
            "layer_selectors": router.layer_selectors, "output_error_per_layer": errors}
