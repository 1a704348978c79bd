"""Dynamic pages: where a cache's logical pages start, cut at prefill by attention entropy.

Page bases, dynamic variant (OVAL's dynamic page sizing): a page is a range
of 1..``max_page`` tokens, the same ranges for every layer, KV head and batch row. At prefill the
sizer measures, for each new token, the entropy of its attention (one layer's queries, mean over
heads and rows), normalised by the log of the keys it sees. The sequence is cut where the entropy
jumps (``page_starts``); each run between cuts is then split evenly into pages of a size that falls
with its entropy (high entropy, diffuse attention: small pages; focused: up to ``max_page``), about
the storage's page size at the median, so that the index costs about what fixed pages cost. Entropy
is computed in chunks of ``CHUNK`` queries against their own keys and the ``OVERLAP`` keys before
them, so memory is linear in the prompt. Decoded tokens fill pages of the storage's page size.
Physical storage stays fixed-size blocks: a page here only names token positions
(``PagedStore.read_tokens`` reads them).
"""

from __future__ import annotations

import math

import torch

CHUNK, OVERLAP = 512, 64
JUMP_WINDOW = 8  # tokens averaged on each side of a candidate cut


def attention_entropy(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Normalised entropy ``[n]`` in [0, 1] of the attention of ``query [B, Hq, n, D]``, the last ``n``
    of the ``keys [B, Hkv, length, D]``, over the keys each sees within its chunk and overlap."""
    b, hq, n, d = query.shape
    hkv, length = keys.shape[1], keys.shape[2]
    grouped = query.reshape(b, hkv, hq // hkv, n, d)
    out = query.new_empty(n, dtype=torch.float32)
    for start in range(0, n, CHUNK):  # chunks of queries, not tokens: memory CHUNK x (CHUNK + OVERLAP)
        stop = min(start + CHUNK, n)
        first = max(0, length - n + start - OVERLAP)
        q = grouped[:, :, :, start:stop].float()
        k = keys[:, :, first:length - n + stop].float()
        scores = (q @ k[:, :, None].transpose(-1, -2)) * scaling  # [B, Hkv, G, c, keys]
        query_pos = torch.arange(length - n + start, length - n + stop, device=q.device)
        key_pos = torch.arange(first, length - n + stop, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean((0, 1, 2))
        seen = visible.sum(-1).clamp_min(2).to(entropy.dtype)
        out[start:stop] = entropy / seen.log()
    return out.clamp_(0.0, 1.0)


def page_starts(entropy: torch.Tensor, page_size: int, max_page: int, jump: float) -> torch.Tensor:
    """Offsets (from 0, ascending, the first 0) of the pages cut from tokens with ``entropy [n]``.

    A jump at ``t`` is a local maximum of ``|mean(e[t:t+W]) - mean(e[t-W:t])|`` (``W = JUMP_WINDOW``,
    so single noisy tokens do not cut) above its mean by ``jump`` standard deviations. A run between
    jumps is split evenly into pages of about ``page_size * 2 ** (log2(max_page) * (1/2 - u))`` tokens,
    ``u`` the quantile of the run's mean entropy among the tokens': ``page_size`` at the median,
    ``max_page`` where attention is most focused, a few tokens where it is most diffuse.
    """
    entropy, n = entropy.float().cpu(), entropy.shape[0]
    if n <= 1:
        return torch.zeros(min(n, 1), dtype=torch.long)
    total = torch.cat([torch.zeros(1), entropy.cumsum(0)])
    t = torch.arange(n)
    lo, hi = (t - JUMP_WINDOW).clamp(min=0), (t + JUMP_WINDOW).clamp(max=n)
    left = (total[t] - total[lo]) / (t - lo).clamp(min=1)
    right = (total[hi] - total[t]) / (hi - t)
    change = (right - left).abs()
    change[0] = 0.0
    high = change > change.mean() + jump * change.std()
    peak = (change >= change.roll(1)) & (change > change.roll(-1)) & high
    peak[0] = True
    run = peak.cumsum(0) - 1  # [n]: the run each token belongs to
    runs = int(run[-1]) + 1
    run_len = torch.bincount(run, minlength=runs)
    run_entropy = torch.zeros(runs).index_add_(0, run, entropy) / run_len
    quantile = torch.searchsorted(entropy.sort().values, run_entropy) / n  # [runs] in [0, 1]
    size = (page_size * 2.0 ** (math.log2(max_page) * (0.5 - quantile))).round().clamp(1, max_page)
    pieces = (run_len / size).ceil()
    piece_len = (run_len / pieces).ceil().long()  # even split of each run
    run_start = torch.cumsum(run_len, 0) - run_len
    offset = t - run_start[run]
    return (offset % piece_len[run] == 0).nonzero().flatten()


class PageLayout:
    """The page starts of one cache's token sequence, grown as tokens arrive: ``cut`` after a
    prefill (entropy sizer), ``cover`` for decoded tokens (pages of ``page_size``)."""

    def __init__(self, page_size: int, max_page: int, jump: float) -> None:
        self.page_size, self.max_page, self.jump = page_size, max_page, jump
        self.starts = torch.zeros(0, dtype=torch.long)
        self.length = 0
        self._decoding = False  # the last page takes decoded tokens up to page_size
        # the page of each token and the page sizes up to a length, computed once for every layer
        self._index: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    @property
    def pages(self) -> int:
        return self.starts.shape[0]

    def cut(self, entropy: torch.Tensor) -> None:
        """Pages for ``len(entropy)`` new prefill tokens, from their attention entropy."""
        if entropy.shape[0]:
            offsets = page_starts(entropy, self.page_size, self.max_page, self.jump)
            self.starts = torch.cat([self.starts, offsets + self.length])
            self.length += entropy.shape[0]
            self._decoding = False

    def cover(self, length: int) -> None:
        """Pages for tokens up to ``length`` not yet placed: decoded tokens, ``page_size`` a page."""
        if length <= self.length:
            return
        ps = self.page_size
        first = self.length
        if self._decoding and self.pages:
            first = int(self.starts[-1]) + ps
        if first < length:
            self.starts = torch.cat([self.starts, torch.arange(first, length, ps)])
        self.length, self._decoding = length, True

    def truncate(self, length: int) -> None:
        """Forget pages past ``length`` tokens (a crop); idempotent, as each layer calls it."""
        if length < self.length:
            self.starts = self.starts[self.starts < length]
            self.length = length

    def clear(self) -> None:
        self.starts = self.starts[:0]
        self.length, self._decoding = 0, False

    def _indexed(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The page of each of the first ``length`` tokens and the sizes of their pages, kept while
        the starts and the length stay the same (every layer of a step asks the same)."""
        memo = self._index
        if memo is None or memo[0] is not self.starts or memo[1] != length:
            pages = torch.searchsorted(self.starts, torch.arange(length), right=True) - 1
            starts = self.starts[self.starts < length]
            memo = self.starts, length, pages, torch.diff(starts, append=torch.tensor([length]))
            self._index = memo
        return memo[2], memo[3]

    def page_of(self, lo: int, hi: int) -> torch.Tensor:
        """The page of each token position in ``[lo, hi)``."""
        return self._indexed(hi)[0][lo:hi]

    def sizes(self, length: int | None = None) -> torch.Tensor:
        """Tokens per page ``[pages]`` of the first ``length`` tokens (all placed ones by default)."""
        return self._indexed(self.length if length is None else length)[1]

    def histogram(self) -> dict[int, int]:
        """Pages per size, of the pages cut at prefill and decode alike."""
        sizes, counts = self.sizes().unique(return_counts=True)
        return {int(s): int(c) for s, c in zip(sizes, counts, strict=True)}

    def mean_size(self) -> float:
        return self.length / self.pages if self.pages else math.nan
