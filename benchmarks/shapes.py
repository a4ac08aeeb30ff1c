"""The target shapes the GPU benchmarks price their steps at (random weights, real sizes):
SmolLM2-135M (the recipe's target, its config.json beside this file) and Qwen3-8B, with the
taps a 5-layer drafter reads, and the tiny sizes `--smoke` swaps in on the CPU."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers import LlamaConfig, Qwen3Config


@dataclass(frozen=True)
class Shape:
    config: type[transformers.PretrainedConfig]
    sizes: dict
    taps: list[int]

    def target_config(self, smoke: bool = False) -> transformers.PretrainedConfig:
        """The target's config at these sizes (SMOKE's where `smoke`)."""
        return self.config(**self.sizes | (SMOKE if smoke else {}), attn_implementation="sdpa")

    def target_taps(self, smoke: bool = False) -> list[int]:
        """The taps that exist at those sizes."""
        layers = (SMOKE if smoke else self.sizes)["num_hidden_layers"]
        return [t for t in self.taps if t < layers]


# --smoke: tiny shapes on the CPU that still take every code path (graphs are CUDA-only).
SMOKE = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1024)  # fmt: skip

SHAPES = {
    "smollm2": Shape(
        LlamaConfig,
        json.loads(Path(__file__).with_name("smollm2-135m.json").read_text()),
        [1, 8, 14, 20, 27],
    ),
    "qwen3-8b": Shape(
        Qwen3Config,
        dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        [1, 9, 17, 25, 33],
    ),
}  # fmt: skip
