"""Retraining OVAL's query scorer when its hit rate drifts.

``DriftRetrainer`` watches the shadow samples of the caches it is attached to (full attention every
``shadow_every`` decode steps, ``kvfactory.selectors.sparse``) and keeps the last ``samples`` of them:
a layer's queries, the int8 key codes its scorer read and full attention's mass per page. When
``kvfactory.metrics.HitRateAlert`` fires (the mean hit rate under ``threshold`` for ``duration_s``;
0.82 for three minutes by default), a background thread fine-tunes a copy of the scorer's query
projections on them for ``steps`` Adam steps of ``batch`` samples each (the KL divergence of its
estimated page shares from full attention's, as training does), then puts the copy in the router's
slot
(``kvfactory.selectors.oval.RouterSlot``): every selector of that router file, in every cache,
scores with it from its next layer on. The key projections and code scales stay frozen, so the codes
already stored stay valid and nothing is re-encoded; each layer's scoring reads the slot once, so
a layer scores with one scorer or the other, whole.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvfactory.metrics import HitRateAlert, metrics_of
from kvfactory.selectors.oval import router_path, router_slot
from kvfactory.selectors.oval.lowrank import LowRankScorer


@dataclass
class ShadowSample:
    """One layer's shadow step: what its scorer read and what full attention did."""

    layer: int
    page_size: int
    queries: torch.Tensor  # [B, Hkv, R, D]: the KV heads' query rows
    codes: torch.Tensor  # [B, Hkv, rank, T]: the stored tokens' int8 codes (a copy)
    mass: torch.Tensor  # [B, Hkv, pages]: full attention's mass per page


def sample_loss(scorer: LowRankScorer, sample: ShadowSample) -> torch.Tensor:
    """KL(full attention's page mass || the scorer's estimated shares) over the pages it chooses among
    (the first and last pages are always read)."""
    pages = sample.mass.shape[-1]
    allowed = (torch.arange(pages) >= 1) & (torch.arange(pages) < pages - 1)
    target = sample.mass.float() * allowed
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-9)
    estimate = scorer.page_shares(sample.queries, sample.codes, sample.layer, sample.page_size) * allowed
    estimate = estimate / estimate.sum(-1, keepdim=True).clamp(min=1e-12)
    return (target * (target.clamp(min=1e-9).log() - estimate.clamp(min=1e-12).log())).sum(-1).mean()


class DriftRetrainer:
    """Retrains the query scorer of router file ``router`` (see the module docstring); ``attach`` it to
    the caches to watch. ``history`` has one record per retraining."""

    def __init__(self, router: str = "embedded", threshold: float = 0.82, duration_s: float = 180.0,
                 window: int = 64, samples: int = 2048, steps: int = 40, batch: int = 64, lr: float = 1e-3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if samples < 1 or steps < 1 or batch < 1 or not lr > 0:
            raise ValueError(f"samples={samples}, steps={steps}, batch={batch}, lr={lr}: expected samples, "
                             f"steps and batch >= 1 and lr > 0")
        self.slot = router_slot(str(router_path(router)))
        if not isinstance(self.slot.module, LowRankScorer):
            raise ValueError(f"router {router!r} is a {self.slot.module.kind} router: only the query scorer "
                             f"is retrained on drift")
        self.alert = HitRateAlert(self._on_alert, threshold, duration_s, window, clock)
        self.samples: deque[ShadowSample] = deque(maxlen=samples)
        self.steps, self.batch, self.lr, self.clock = steps, batch, lr, clock
        self.history: list[dict[str, Any]] = []
        self._thread: threading.Thread | None = None

    def attach(self, source: Any) -> DriftRetrainer:
        """Watch the shadow samples of ``source``: a cache whose selector reads this router (or its
        metrics), or a ``kvfactory.engine.Engine`` over such caches (each request's cache from its
        admission on)."""
        if hasattr(source, "on_new_cache"):
            selector = source.manager.factory.config.selector
            if selector is None or getattr(selector.build_selector(), "slot", None) is not self.slot:
                raise ValueError(f"the engine's config reads no page selector over this retrainer's router "
                                 f"(selector {None if selector is None else selector.selector!r})")
            source.on_new_cache(self.attach)
            return self
        self.alert.attach(source)
        metrics_of(source).sample_hooks.append(self.record)
        return self

    @property
    def training(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def record(self, store: Any, query: torch.Tensor, mass: torch.Tensor) -> None:
        """Keep one shadow sample of a layer whose selector reads this router."""
        if getattr(store.selector, "slot", None) is not self.slot:
            return
        b, _, _, d = query.shape
        hkv = mass.shape[1]
        with torch.inference_mode(False):  # copies that training can use, from an engine's inference mode too
            self.samples.append(ShadowSample(store.layer_idx, store.page_size,
                                             query.detach().reshape(b, hkv, -1, d).float().clone(),
                                             store.summaries.codes.clone(), mass.detach().float().clone()))

    def _on_alert(self, hit_rate: float, seconds: float) -> None:
        if not self.training:
            self._thread = threading.Thread(target=self.retrain, args=(hit_rate,), name="oval-retrain",
                                            daemon=True)
            self._thread.start()

    def retrain(self, hit_rate: float = float("nan")) -> dict[str, Any]:
        """Fine-tune a copy of the scorer's query projections on the samples kept, then swap it in."""
        started = self.clock()
        samples = list(self.samples)
        if not samples:
            raise RuntimeError("no shadow samples to retrain on: shadow_every must be > 0")
        tuned = copy.deepcopy(self.slot.module)
        tuned.requires_grad_(False)
        tuned.query.requires_grad_(True)
        optimizer = torch.optim.Adam([tuned.query], lr=self.lr)
        with torch.no_grad():
            before = sum(float(sample_loss(tuned, s)) for s in samples) / len(samples)
        gen = torch.Generator().manual_seed(len(self.history))
        for _ in range(self.steps):
            optimizer.zero_grad()
            chosen = torch.randperm(len(samples), generator=gen)[:self.batch].tolist()
            (sum(sample_loss(tuned, samples[i]) for i in chosen) / len(chosen)).backward()
            optimizer.step()
        tuned.requires_grad_(False)
        with torch.no_grad():
            after = sum(float(sample_loss(tuned, s)) for s in samples) / len(samples)
        self.slot.module = tuned.eval()  # the swap: one assignment, read once per layer's scoring
        record = {"at": started, "hit_rate": hit_rate, "samples": len(samples), "steps": self.steps,
                  "batch": self.batch,
                  "loss_before": before, "loss_after": after, "seconds": self.clock() - started}
        self.history.append(record)
        return record

    def wait(self, timeout: float | None = None) -> None:
        """Block until a retraining in progress has swapped its scorer in."""
        if self._thread is not None:
            self._thread.join(timeout)
