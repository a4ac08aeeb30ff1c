"""Regenerate's token step (decoding/batched.py runs it after the shared layers, layers.py):
every row's decode state, declared once (`decode_state`), and the step's token choice and state
update in place (`advance`: greedy or sampled, stop tokens and limits, the step's read-back)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflashpipe.decoding.sampling import Sampling, draw


def decode_state(rows: int, capacity: int, device: torch.device) -> dict[str, Tensor]:
    """Every row's decode state, idle: the step's graph inputs and outputs, which `advance`
    updates in place (the engine's, and benchmarks/draw.py's)."""
    long = {"dtype": torch.long, "device": device}
    return {
        "token": torch.zeros(rows, **long),  # the next input (not cached yet)
        "length": torch.zeros(rows, **long),  # committed slots = the input's position
        "produced": torch.zeros(rows, **long),  # answer tokens so far
        "limit": torch.zeros(rows, **long),  # the request's max_new_tokens
        "active": torch.zeros(rows, dtype=torch.bool, device=device),
        "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
        "uniforms": torch.zeros(rows, capacity, device=device),  # (R, C) float32
        "packed": torch.zeros(3, rows, **long),  # [emitted, token, done]: the read-back
    }


def advance(
    norm: nn.Module, lm_head: nn.Module, x: Tensor, state: dict[str, Tensor], stops: Tensor,
    sampling: Sampling | None, softcap: float | None = None,
) -> None:  # fmt: skip
    """The step's tokens from the last layer's rows x (R, H) and every row's state, in place:
    active rows take their token (the argmax, or `draw` for sampled rows when `sampling`),
    length and produced += 1, done = a stop token or the row's limit reached; packed (3, R) =
    [emitted, token, done], the step's read-back."""
    s = state
    logits = lm_head(norm(x)).float()  # (R, V)
    if softcap is not None:  # Gemma's final logit soft-capping
        logits = torch.tanh(logits / softcap) * softcap
    token = logits.argmax(-1)  # (R,)
    if sampling is not None:
        t = s["produced"].clamp(max=s["uniforms"].shape[1] - 1)[:, None]  # (R, 1)
        drawn = draw(logits, s["uniforms"].gather(1, t)[:, 0], sampling)  # (R,)
        token = torch.where(s["sampled"], drawn, token)
    active = s["active"].clone()  # (R,) bool
    step = active.long()  # (R,)
    s["produced"].add_(step)
    s["length"].add_(step)
    done = active & ((token[:, None] == stops[None]).any(-1) | (s["produced"] >= s["limit"]))
    s["packed"].copy_(torch.stack([step, token, done.long()]))  # (3, R)
    s["token"].copy_(torch.where(active, token, s["token"]))
    s["active"].copy_(active & ~done)
