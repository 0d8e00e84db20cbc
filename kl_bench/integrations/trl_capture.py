"""What the TRL adapter's hooks capture from TRL's own passes: one model call (:class:`Capture`), and the
decoding steps of generate() (:class:`Generation`), whose rows are matched to the scored rows by their
tokens."""
from __future__ import annotations

import torch


class Capture:
    """What one model call made: its role, keyword inputs, body hidden states and output."""

    def __init__(self, role: str, kwargs: dict):
        self.role, self.kwargs, self.hidden = role, kwargs, None

    @property
    def scoring(self) -> bool:
        """A scoring pass (TRL's log-probs), not a generate() step."""
        kw = self.kwargs
        return bool(kw.get("fused_lm_head")) or "labels" in kw or kw.get("use_cache") is False


class Generation:
    """The decoding steps of generate() on the policy: each step's last hidden state, predicting the next
    token, and the ids fed in (the prompt, then the tokens drawn). Rows are matched to scored rows by
    their tokens."""

    def __init__(self):
        self.ids, self.mask, self.hidden = None, None, []

    def step(self, kwargs: dict, hidden: torch.Tensor, limit: int) -> None:
        ids = kwargs.get("input_ids")
        if ids is None or hidden is None:
            return
        if ids.shape[1] > 1 or self.ids is None:                     # a prefill starts a new generation
            self.ids, self.hidden = ids[:limit].detach(), []
            mask = kwargs.get("attention_mask")
            self.mask = torch.ones_like(self.ids) if mask is None else mask[:limit, -ids.shape[1]:].detach()
        else:
            self.ids = torch.cat([self.ids, ids[:limit].detach()], dim=1)
            self.mask = torch.cat([self.mask, torch.ones_like(ids[:limit])], dim=1)
        self.hidden.append(hidden[:limit, -1].detach())

    def match(self, input_ids: torch.Tensor, attention: torch.Tensor, k: int) -> torch.Tensor | None:
        """The drawing pass's hidden states [B, k, d] of scored rows (ids [B, L], last k completion), or
        None when some row was not drawn in the captured generation. The ids and masks of both sides come
        to the host in one transfer (one synchronisation, whatever the number of rows); rows are matched
        there by their unpadded prompt and first k − 1 completion tokens."""
        if self.ids is None or len(self.hidden) < k:
            return None
        hidden = torch.stack(self.hidden[:k], dim=1)                  # [G, k, d]
        prompt = self.ids.shape[1] - (len(self.hidden) - 1)
        parts = [self.ids, self.mask, input_ids, attention]
        flat = torch.cat([x.reshape(-1).to(device=self.ids.device, dtype=torch.long) for x in parts]).tolist()
        sizes = [x.numel() for x in parts]
        drawn, drawn_mask, scored, scored_mask = (_rows(flat[sum(sizes[:i]):sum(sizes[:i + 1])], x.shape[-1])
                                                  for i, x in enumerate(parts))
        keys = {}
        for row, (ids, mask) in enumerate(zip(drawn, drawn_mask)):
            keys.setdefault(_key(ids, mask, prompt, prompt + k - 1), row)
        rows = []
        for ids, mask in zip(scored, scored_mask):
            key = _key(ids, mask, len(ids) - k, len(ids) - 1)
            if key not in keys:
                return None
            rows.append(keys[key])
        # host: the matched rows' indices, made from the host lists above
        return hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]


def _rows(flat: list[int], width: int) -> list[list[int]]:
    return [flat[i:i + width] for i in range(0, len(flat), width)]


def _key(ids: list[int], mask: list[int], prompt: int, end: int) -> tuple[int, ...]:
    """A row's prompt tokens where its mask is set, then its tokens [prompt, end)."""
    return tuple(t for t, m in zip(ids[:prompt], mask[:prompt]) if m) + tuple(ids[prompt:end])
