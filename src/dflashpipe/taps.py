"""Layer taps: the outputs of chosen decoder layers of a target, kept by forward hooks.

    target forward ─► decoder layer i (i in layer_ids) ─► hook keeps its output (HF
    hidden_states[i+1]) ─► gather(): the kept outputs side by side, (B, T, n_layers*H)

One implementation for every reader of the target's hidden states: extract writes them to
feature shards, decoding hands them to the drafter; the same hooks give the same states.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerTaps:
    """Forward hooks that keep the outputs of the tapped decoder layers (HF hidden_states[i+1])."""

    def __init__(self, base: nn.Module, layer_ids: list[int]):
        self.layer_ids = layer_ids
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [base.layers[i].register_forward_hook(self._hook(i)) for i in layer_ids]

    def _hook(self, i: int):
        def keep(module, args, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output

        return keep

    def gather(self) -> torch.Tensor:
        out = torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)  # (B, T, L*H)
        self.outputs.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
