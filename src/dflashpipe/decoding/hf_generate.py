"""transformers' generate() on left-padded batches: regenerate's path for targets the batched
engine (batched.py) does not support, or with `regenerate.engine: hf`.

A batch's rows decode until its last row ends (finished rows keep decoding), each batch padded to
a power-of-two width so the compiled static-cache decode step sees few shapes.
"""

from __future__ import annotations

import logging

import torch

from dflashpipe.config import RegenerateConfig
from dflashpipe.decoding.memory import generate_rows, roomy_allocator

log = logging.getLogger(__name__)


def generation_config(
    gen: RegenerateConfig, eot: set[int], pad_id: int, device: torch.device, sampled: bool
):
    from transformers import GenerationConfig

    # A fresh config: the model's own sampling defaults must not leak into "greedy".
    cache = gen.cache if gen.cache != "auto" else ("static" if device.type == "cuda" else "dynamic")
    extra = (
        {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k} if sampled else {}
    )
    return GenerationConfig(
        max_new_tokens=gen.max_new_tokens,
        do_sample=sampled,
        eos_token_id=sorted(eot),
        pad_token_id=pad_id,
        cache_implementation=cache,
        **extra,
    )


def padded_shape(lengths: list[int], batch_size: int, width: int = 0) -> tuple[int, int]:
    """(rows, width) of a generate() call: widths round up to a power of two (>= 64, at least
    `width`) and a short last batch is filled up to batch_size, so the shapes are few."""
    width = max(width, 64, 1 << (max(lengths) - 1).bit_length())
    return max(batch_size, len(lengths)), width


def fitting_rows(model, batch_size: int, width: int, max_new_tokens: int) -> int:
    """The rows one generate() call decodes: batch_size, or as many as the device's free memory
    holds (memory.generate_rows: the static cache, the prefill's activations, a step's buffers)
    with a warning; ValueError when not even one row fits."""
    roomy_allocator(model.device)
    fit = generate_rows(model, batch_size, width, max_new_tokens)
    if fit == 0:
        raise ValueError(
            f"not even one prompt padded to {width} tokens with {max_new_tokens} new tokens fits "
            "generate()'s cache and prefill in the device's free memory; use shorter prompts "
            "(regenerate.max_prompt_tokens) or fewer new tokens"
        )
    if fit < batch_size:
        log.warning("generate(): %d rows x %d prompt tokens + %d new do not fit the device's free "
                    "memory; decoding %d rows per call", batch_size, width, max_new_tokens, fit)  # fmt: skip
    return fit


@torch.inference_mode()
def generate_batch(
    model, prompts: list[list[int]], gen_cfg, eot: set[int], batch_size: int = 0, width: int = 0,
    max_rows: int | None = None,
) -> list[tuple]:  # fmt: skip
    """(new token ids incl. the end-of-turn token, finish reason) per prompt; left padding. With
    `max_rows` (fitting_rows) below the batch, it decodes in calls of max_rows rows, each filled
    up to max_rows, so every call has one shape."""
    rows, width = padded_shape(list(map(len, prompts)), batch_size, width)
    if max_rows and max_rows < rows:
        return [
            answer
            for i in range(0, len(prompts), max_rows)
            for answer in generate_batch(
                model, prompts[i : i + max_rows], gen_cfg, eot, max_rows, width
            )  # fmt: skip
        ]
    ids = torch.full((rows, width), gen_cfg.pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for row in range(rows):
        p = prompts[row % len(prompts)]  # filler rows repeat real prompts; their output is dropped
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        generation_config=gen_cfg,
    )
    results = []
    for row in out[: len(prompts), width:].tolist():
        stop = next((k for k, t in enumerate(row) if t in eot), None)
        results.append((row[: stop + 1], "stop") if stop is not None else (row, "length"))
    return results
