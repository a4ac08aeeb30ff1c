"""What the batched engine's buffers take (its static cache and a step's vocabulary-wide
tensors) against the device's free memory: rows that do not fit are refused before anything is
allocated, instead of an out-of-memory error halfway through a shard."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from dflashpipe.decoding.families import head_shape

MEMORY_SHARE = 0.9  # of the free memory the engine's buffers may take (the rest: allocator slack)
STEP_FLOATS = 4  # float32 (R, V) tensors a sampled step holds at once (logits, sort, cdf, mask)


def cache_bytes(model: nn.Module, rows: int, capacity: int) -> int:
    """The static cache: rows x capacity x layers x 2 (K, V) x kv_heads x head_dim x dtype
    bytes (plus the scratch row)."""
    _, kv_heads, head_dim = head_shape(model.config)
    layers = model.config.get_text_config().num_hidden_layers  # any family (generate()'s too)
    size = model.get_input_embeddings().weight.element_size()
    return (rows + 1) * capacity * layers * 2 * kv_heads * head_dim * size


def step_bytes(model: nn.Module, rows: int) -> int:
    """What a decode step holds beside the cache: STEP_FLOATS float32 (rows, vocab) tensors."""
    return rows * model.get_output_embeddings().weight.shape[0] * 4 * STEP_FLOATS


def free_memory(device: torch.device) -> int:
    """Bytes free for the engine: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def roomy_allocator(device: torch.device) -> None:
    """Expandable segments for generate(): its prefill allocates tensors of several GB whose
    shapes change from call to call, which fixed segments split until a larger request finds no
    block (Qwen3-8B's shapes on an H100: 12.6 GB reserved but unusable, out of memory at the 201
    rows the sizing allowed). The cached blocks go back to the device first, so the free memory
    the sizing reads is all there is."""
    if device.type == "cuda":  # torch 2.11 deprecates the older name (a FutureWarning)
        settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
        torch.cuda.empty_cache()


def check_fit(model: nn.Module, rows: int, capacity: int, budget: int | None = None) -> None:
    """Refuse (ValueError) rows x capacity whose cache and step buffers exceed `budget` bytes
    (None: MEMORY_SHARE of the device's free memory), before anything is allocated."""
    device = model.get_input_embeddings().weight.device
    budget = int(MEMORY_SHARE * free_memory(device)) if budget is None else budget
    cache, step = cache_bytes(model, rows, capacity), step_bytes(model, rows)
    if cache + step > budget:
        gib = 2**30
        raise ValueError(
            f"{rows} rows x {capacity} slots need {cache / gib:.2f} GiB of KV cache (rows x "
            f"capacity x layers x 2 x kv_heads x head_dim x dtype bytes) + {step / gib:.2f} GiB "
            f"of step buffers, more than the {budget / gib:.2f} GiB budget on {device}; use "
            "fewer rows or a smaller capacity (longest prompt + max_new_tokens)"
        )


def prefill_bytes(model: nn.Module, rows: int, width: int) -> int:
    """The largest activations of generate()'s prefill, one forward over rows x width tokens:
    the MLP's gate, up and activated tensors (3 x intermediate) and a few hidden-size ones
    beside them (the residual, the normed input, the attention output: 4 x hidden). At Qwen3-8B's
    shapes (256 rows x 1,024) one of the MLP's tensors is the 6 GiB an 80 GB card could not
    allocate."""
    config = model.config.get_text_config()
    hidden = config.hidden_size
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden  # GPT-2's n_inner: None
    size = model.get_input_embeddings().weight.element_size()
    return rows * width * (3 * mlp + 4 * hidden) * size


def generate_rows(model: nn.Module, rows: int, width: int, max_new_tokens: int,
                  budget: int | None = None) -> int:  # fmt: skip
    """How many of `rows` prompts padded to `width` one generate() call can decode in `budget`
    bytes (None: MEMORY_SHARE of the device's free memory): its static cache of width +
    max_new_tokens slots, the prefill's activations and a step's vocabulary-wide buffers grow
    with the rows; 0 when not even one row fits."""
    device = model.get_input_embeddings().weight.device
    budget = int(MEMORY_SHARE * free_memory(device)) if budget is None else budget

    def need(n: int) -> int:
        cache = cache_bytes(model, n, width + max_new_tokens)
        return cache + prefill_bytes(model, n, width) + step_bytes(model, n)

    per_row = need(2) - need(1)  # every term is linear in the rows (the cache's scratch row aside)
    return max(0, min(rows, (budget - (need(1) - per_row)) // per_row))
