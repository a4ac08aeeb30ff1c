"""What extract.codec does to the target's distribution read from its stored final hidden state
(issue 62, item 1), on the real SmolLM2-135M-Instruct on the CPU:

    python benchmarks/final_hidden_codec.py --out final_hidden_codec.json

The target answers real prompts (HumanEval and ShareGPT's first turns as chat turns) once
greedily and once sampled at temperature 0.7 / top_p 0.95, as regenerate's x4 answers are made;
at every answer position its final hidden state (after the last norm, in bf16 as extract stores
it) goes through each codec's own encode / decode, and the frozen LM head turns each decoded
state into the distribution that train.loss's forward KL and greedy labels read. Reported per
codec against the bf16 state's distribution: the mean and 99th-percentile KL(bf16 || codec) in
nats, the share of positions whose argmax (a greedy label) changes, and the mean total variation.
The bf16 state itself is held against the float32 state the same way (what storing bf16 costs).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from dflashpipe.chat import encode_prompt
from dflashpipe.codecs import decode, encode
from dflashpipe.config import TargetConfig
from dflashpipe.target import load_target

REPO = Path(__file__).resolve().parent.parent
RES = REPO / "resources"
CODECS = ("bf16-zstd", "fp8-zstd", "fp4-zstd")


def prompts(n: int) -> list[str]:
    """n // 2 HumanEval prompts and n - n // 2 ShareGPT first human turns (the recipe's files)."""
    with gzip.open(RES / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        code = [json.loads(line)["prompt"] for line in f][: n // 2]
    with open(RES / "sharegpt" / "ShareGPT_V3_unfiltered_cleaned_split.json") as f:
        text = f.read(8_000_000)  # the file's head: its first records (the whole is 670 MB)
    decoder, pos, chat = json.JSONDecoder(), text.index("{"), []
    while len(chat) < n - n // 2:
        rec, pos = decoder.raw_decode(text, pos)
        pos = text.index("{", pos)
        turns = rec.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 20 < len(turns[0]["value"]) < 1500:
            chat.append(turns[0]["value"])
    return code + chat


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """KL(ref || other), argmax changes and total variation between two (N, V) logit tensors."""
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "argmax_changed": (ref.argmax(-1) != other.argmax(-1)).float().mean().item(),
        "tv_mean": 0.5 * (lp.exp() - lq.exp()).abs().sum(-1).mean().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="final_hidden_codec.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = TargetConfig(model=str(RES / "smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tok = load_target(cfg, torch.device("cpu"))
    head, hidden_size = model.get_output_embeddings(), model.config.hidden_size
    states = []  # (T, H) float32 final states over each answer's positions
    start = time.perf_counter()
    for text in prompts(args.prompts):
        ids = torch.tensor([encode_prompt(tok, [{"role": "user", "content": text}])])
        for sampled in (False, True):
            gen = dict(do_sample=True, temperature=0.7, top_p=0.95) if sampled else {}
            out = model.generate(
                ids, max_new_tokens=args.new_tokens, pad_token_id=tok.eos_token_id, **gen
            )
            answer = out[0, ids.shape[1] :].tolist()
            if tok.eos_token_id in answer:  # the positions up to the answer's end, no padding
                out = out[:, : ids.shape[1] + answer.index(tok.eos_token_id) + 1]
            with torch.inference_mode():
                last = model.model(input_ids=out).last_hidden_state[0, ids.shape[1] - 1 : -1]
            states.append(last)
    full = torch.cat(states)  # (N, H) float32
    bf16 = full.to(torch.bfloat16)
    with torch.inference_mode():
        ref = head(bf16.float())
        result = {"tokens": full.shape[0], "prompts": args.prompts, "new_tokens": args.new_tokens,
                  "bf16_vs_float32": compare(head(full), ref), "codecs": {}}  # fmt: skip
        for codec in CODECS:
            enc = encode(bf16, codec, 1)
            nbytes = len(enc.hidden) + len(enc.scales or b"")
            back = decode(enc, codec, full.shape[0], hidden_size, 1)
            result["codecs"][codec] = {"bytes_per_token": nbytes / full.shape[0],
                                       **compare(ref, head(back.float()))}  # fmt: skip
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
