"""Decode speed of the evaluate stage's methods at SmolLM2-135M shapes, measured in one run.

Target: SmolLM2-135M-Instruct's shape (`smollm2-135m.json`: 30 layers, hidden 576) with random
weights; drafter: 5 layers tapping [1, 8, 14, 20, 27], random. Random weights never emit an
end-of-turn token and a random drafter is almost never accepted, so every response runs the same
number of steps: the figures are the cost of one step of each method, which is what sizes the
quality benchmark's evaluate stage (its wall time = steps x cost per step, per method).

    python benchmarks/evaluate.py --prompts 3 --new-tokens 96 --out $OUT/evaluate.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.speculative import (
    DFlashProposer,
    PromptLookupProposer,
    Target,
    greedy_decode,
    speculative_decode,
)

SHAPE = Path(__file__).with_name("smollm2-135m.json")
TAPS = [1, 8, 14, 20, 27]


def build(device: torch.device, dtype: torch.dtype, smoke: bool):
    shape = json.loads(SHAPE.read_text())
    if smoke:
        shape |= dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    with device:
        target = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    target = target.to(dtype).eval().requires_grad_(False)
    taps = [t for t in TAPS if t < shape["num_hidden_layers"]]
    cfg = DrafterConfig.from_target(
        target.config, mask_token_id=0, num_layers=5, block_size=16, target_layer_ids=taps
    )
    drafter = Drafter.from_target_model(cfg, target).to(device)
    drafter.reset_parameters()
    return target, drafter.to(dtype).eval(), taps


def per_step(decoded) -> float:
    """Seconds per decode step (a verify forward, or one token for target-only)."""
    steps = len(decoded.accepted_lengths) or decoded.decode_tokens
    return decoded.decode_s / max(1, steps)


def measure(device, dtype, prompts, new_tokens, smoke) -> dict:
    model, drafter, taps = build(device, dtype, smoke)
    target = Target(model, taps)
    methods = {
        "target": lambda ids: greedy_decode(target, ids, new_tokens, set()),
        "dflash": lambda ids: speculative_decode(
            target, DFlashProposer(drafter), ids, new_tokens, set()
        ),
        "prompt_lookup": lambda ids: speculative_decode(
            target, PromptLookupProposer(10, 2), ids, new_tokens, set()
        ),
    }
    out = {}
    for name, fn in methods.items():
        fn(prompts[0])  # warm-up
        runs = [fn(p) for p in prompts]
        out[name] = {
            "ms_per_step": 1e3 * statistics.median(per_step(r) for r in runs),
            "ms_prefill": 1e3 * statistics.median(r.prefill_s for r in runs),
            "tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "tau": statistics.median(r.acceptance_length or 1.0 for r in runs),
        }
    target.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-length", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", default="evaluate.json")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, 49152, (args.prompt_length,), generator=g).tolist()
        for _ in range(args.prompts)
    ]
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for name in args.dtypes:
        res[name] = measure(device, getattr(torch, name), prompts, args.new_tokens, args.smoke)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"{'dtype':<10}{'method':<15}{'ms/step':>9}{'prefill ms':>12}{'tok/s':>9}{'tau':>6}")
    for name in args.dtypes:
        for method, r in res[name].items():
            print(f"{name:<10}{method:<15}{r['ms_per_step']:>9.2f}{r['ms_prefill']:>12.2f}"
                  f"{r['tokens_per_s']:>9.1f}{r['tau']:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
