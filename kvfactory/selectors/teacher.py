"""The teacher pass: full attention's page mass at sampled decode positions, for fitting page selection.

Text is cut into windows and run through the frozen model once each with full attention
(``collect``). At sampled query positions ``t`` every routed layer records the attention mass each
page of ``PAGE`` tokens gets from the query at ``t`` (the group's query heads averaged per KV head,
causal), what leaving the page out costs the attention output (``impact``), Quest's score for
comparison (``kvfactory.selectors.quest``), the pages' summaries (key maximum, minimum and mean per
channel) and the decoder's last hidden state at ``t - 1``; with
``keys`` also the keys themselves and the sampled queries (what OVAL's query scorer learns from),
with ``values`` the values too (what the attention output of a page choice is measured with). Read-budget
calibration (``calibrate.py``) and OVAL's router training (``oval/train.py``) both learn from it;
both count the sink page and the current page as always read (``candidates``, ``chosen_count``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvfactory.selectors.pages import split_rows

PAGE = 16
TEACHER = "kvfactory_oval_teacher"


@dataclass
class Chunk:
    """One chunk's teacher record (``S`` query positions, ``L`` routed layers, ``P`` pages)."""

    features: torch.Tensor  # [L, Hkv, P, 3D]: key max | min | mean per page
    hidden: torch.Tensor  # [S, hidden]: the decoder's last hidden state before each query position
    current: torch.Tensor  # [S]: the page holding each query position
    mass: torch.Tensor  # [S, L, Hkv, P]: full-attention mass per page (0 after the current page)
    quest: torch.Tensor  # [S, L, Hkv, P]: Quest's score per page
    keys: torch.Tensor | None = None  # [L, Hkv, P * PAGE, D]: the keys (``collect(keys=True)``)
    queries: torch.Tensor | None = None  # [S, L, Hq, D]: the queries at the sampled positions
    positions: torch.Tensor | None = None  # [S]: the sampled query positions (with the keys)
    layers: tuple[int, ...] = ()  # the model layers recorded, in order
    impact: torch.Tensor | None = None  # [S, L, Hkv, P]: what leaving each page out moves the output
    values: torch.Tensor | None = None  # [L, Hkv, P * PAGE, D]: the values (``collect(values=True)``)
    scaling: float | None = None  # the attention's score scale (with the values)


class _Recorder:
    def __init__(self, positions: torch.Tensor, layers: Sequence[int], keys: bool, values: bool, impact: bool
                 ) -> None:
        self.positions, self.layers, self.keys, self.values = positions, set(layers), keys, values
        self.impact = impact
        self.out: dict[int, PageRecord] = {}
        self.raw: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.value: dict[int, torch.Tensor] = {}
        self.scaling: float | None = None


_recording: _Recorder | None = None


def _teacher_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA, and for routed layers the teacher's record of the sampled queries."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer = getattr(module, "layer_idx", None)
    if _recording is not None and layer in _recording.layers:
        _recording.out[layer] = page_record(query, key, _recording.positions, kwargs.get("scaling"),
                                            value if _recording.impact else None)
        pages = key.shape[2] // PAGE
        if _recording.keys:
            _recording.raw[layer] = (query[0, :, _recording.positions].transpose(0, 1).half(),
                                     key[0, :, :pages * PAGE].half())
        if _recording.values:
            _recording.value[layer] = value[0, :, :pages * PAGE].half()
            scaling = kwargs.get("scaling")
            _recording.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return out


AttentionInterface.register(TEACHER, _teacher_attention)


class PageRecord(NamedTuple):
    """One layer's teacher record of the sampled queries (see ``page_record``)."""

    features: torch.Tensor  # [Hkv, P, 3D]
    mass: torch.Tensor  # [S, Hkv, P]
    quest: torch.Tensor  # [S, Hkv, P]
    impact: torch.Tensor | None  # [S, Hkv, P], with the values


def page_record(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, scaling: float | None,
                value: torch.Tensor | None = None) -> PageRecord:
    """For one layer of a batch-1 forward: page features ``[Hkv, P, 3D]``, mass and Quest's score
    ``[S, Hkv, P]`` of the queries at ``positions`` (as the selector ranks: the paper's bound, each KV
    head's best query head) and, given the values, each page's ``impact``: leaving page ``p`` out of
    a query head's attention moves its output ``o`` by ``|sum_{t in p} a_t (v_t - o)| / (1 - m_p)``;
    the numerator over ``|o|``, averaged over the KV head's query heads, is what a selector loses by
    not reading the page, however much mass it holds (a page whose values are close to ``o`` costs
    little)."""
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    groups, pages = hq // hkv, t // PAGE
    keys = key[0, :, :pages * PAGE].float()
    q = query[0, :, positions].float().view(hkv, groups, -1, d)  # [Hkv, G, S, D]
    scores = q @ keys[:, None].transpose(-1, -2) * (scaling if scaling is not None else d ** -0.5)
    causal = torch.arange(pages * PAGE) > positions[:, None]
    head_probs = scores.masked_fill(causal, float("-inf")).softmax(-1)  # [Hkv, G, S, T]
    probs = head_probs.mean(1)  # [Hkv, S, T]
    mass = probs.view(hkv, -1, pages, PAGE).sum(-1)
    by_page = keys.view(hkv, pages, PAGE, d)
    features = torch.cat([by_page.amax(2), by_page.amin(2), by_page.mean(2)], -1)
    bounds = split_rows(q) @ features[:, None, :, :2 * d].transpose(-1, -2)  # [Hkv, G, S, P]
    impact = None if value is None else page_impact(head_probs, value[0, :, :pages * PAGE].float())
    return PageRecord(features, mass.transpose(0, 1), bounds.amax(1).transpose(0, 1), impact)


def page_impact(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[S, Hkv, P]``: each page's relative pull on the attention output (``page_record``), from each
    query head's ``probs [Hkv, G, S, T]`` and the ``values [Hkv, T, D]``."""
    hkv, groups, s, tokens = probs.shape
    out = probs @ values[:, None]  # [Hkv, G, S, D]
    by_page = probs.view(hkv, groups, s, -1, PAGE)  # [Hkv, G, S, P, PAGE]
    weighted = torch.einsum("hgspk,hpkd->hgspd", by_page, values.view(hkv, -1, PAGE, values.shape[-1]))
    pull = (weighted - by_page.sum(-1, keepdim=True) * out[:, :, :, None]).norm(dim=-1)  # [Hkv, G, S, P]
    return (pull / out.norm(dim=-1, keepdim=True).clamp(min=1e-9)).mean(1).transpose(0, 1)


@torch.no_grad()
def collect(model: Any, ids: torch.Tensor, layers: Sequence[int], positions: int, chunk: int, seed: int,
            advance: Callable[[], None] = lambda: None, keys: bool = False, values: bool = False,
            impact: bool = False) -> list[Chunk]:
    """Teacher records of consecutive ``chunk``-token windows of ``ids`` (1-D), ``positions`` query
    positions each (uniform beyond the first eighth); with ``keys`` the keys and sampled queries too,
    with ``values`` (and ``keys``) the values and the score scale, with ``impact`` each page's
    ``impact``."""
    if values and not keys:
        raise ValueError("values=True needs keys=True: an attention output needs the keys and queries")
    global _recording
    gen = random.Random(seed)
    previous = model.config._attn_implementation
    model.set_attn_implementation(TEACHER)
    records = []
    try:
        for start in range(0, ids.numel() - chunk + 1, chunk):
            window = ids[start:start + chunk][None]
            at = torch.tensor(sorted(gen.sample(range(chunk // 8, chunk), positions)))
            _recording = _Recorder(at, layers, keys, values, impact)
            hidden = model.get_decoder()(input_ids=window).last_hidden_state[0]
            out = [_recording.out[layer] for layer in layers]
            record = Chunk(
                features=torch.stack([o.features for o in out]).half(), hidden=hidden[at - 1].float(),
                current=at // PAGE, mass=torch.stack([o.mass for o in out], 1).half(),
                quest=torch.stack([o.quest for o in out], 1).half(), layers=tuple(layers),
                impact=torch.stack([o.impact for o in out], 1).half() if impact else None)
            if keys:
                record.queries = torch.stack([_recording.raw[layer][0] for layer in layers], 1)
                record.keys = torch.stack([_recording.raw[layer][1] for layer in layers])
                record.positions = at
            if values:
                record.values = torch.stack([_recording.value[layer] for layer in layers])
                record.scaling = _recording.scaling
            records.append(record)
            advance()
    finally:
        _recording = None
        model.set_attn_implementation(previous)
    return records


def candidates(current: torch.Tensor, pages: int) -> torch.Tensor:
    """``[S, P]``: the pages a selector chooses among (after the sink page, before the current one)."""
    index = torch.arange(pages)
    return (index >= 1) & (index < current[:, None])


def chosen_count(current: torch.Tensor, budget: float) -> torch.Tensor:
    """Pages chosen besides the sink and current page at ``budget`` of ``current + 1`` pages: ``[S]``."""
    return (torch.ceil(budget * (current + 1).float()).long() - 2).clamp(min=1)


def tokens_of(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    return torch.cat([tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
                      for text in texts])


def cap(ids: torch.Tensor, chunks: int, chunk: int) -> torch.Tensor:
    """The first ``chunks`` whole chunks of ``ids``."""
    return ids[:min(ids.numel() // chunk, chunks) * chunk]
