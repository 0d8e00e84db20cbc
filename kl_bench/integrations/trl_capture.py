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
        None when some row was not drawn in the captured generation."""
        if self.ids is None or len(self.hidden) < k:
            return None
        hidden = torch.stack(self.hidden[:k], dim=1)                  # [G, k, d]
        keys = {}
        prompt = self.ids.shape[1] - (len(self.hidden) - 1)
        for row in range(self.ids.shape[0]):
            toks = self.ids[row, :prompt][self.mask[row, :prompt].bool()].tolist() + self.ids[row, prompt:prompt + k - 1].tolist()
            keys.setdefault(tuple(toks), row)
        rows = []
        for b in range(input_ids.shape[0]):
            p = input_ids[b, :-k][attention[b, :-k].bool()].tolist() + input_ids[b, -k:-1].tolist()
            if tuple(p) not in keys:
                return None
            rows.append(keys[tuple(p)])
        return hidden[torch.tensor(rows, device=hidden.device)]
