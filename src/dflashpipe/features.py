"""The features train reads: the stage's own manifest, train.extra_features' beside it, the
shards they vouch for, where the target's distribution comes from, and a mask token the data
never uses."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from dflashpipe.errors import DataError
from dflashpipe.shards import FeatureShard, check_manifest


def choose_mask_token(tok, shard_paths: list[Path]) -> int:
    """A special token of the target's vocabulary that never occurs in the training data."""
    used: set[int] = set()
    for path in shard_paths:
        ids = pc.list_flatten(FeatureShard(path).table.column("input_ids").combine_chunks())
        used.update(np.unique(ids.to_numpy()).tolist())
    core = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id}
    for token_id in sorted(tok.added_tokens_decoder):
        if token_id not in used and token_id not in core:
            return token_id
    raise DataError(
        "no special token of the target is unused by the data; set drafter.mask_token_id"
    )


def read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise DataError(f"feature manifest not found: {path}")
    try:
        manifest = json.loads(path.read_text())
        manifest["shards"], manifest["layer_ids"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a feature manifest ({type(e).__name__}: {e})") from None
    return manifest


@dataclass(frozen=True)
class TargetSource:
    """What training reads of the target's distribution: the final hidden states (its whole
    distribution through the LM head: extract.final_hidden) where the features hold them, else
    the top-k soft targets (extract.topk); nothing where the loss needs neither."""

    topk: int = 0  # k of the top-k read per position; 0: not read
    final: bool = False  # the final hidden states read (the last block of `hidden`)

    def describe(self) -> str:
        if self.final and self.topk:
            return ("its whole distribution (the final hidden states through the LM head), "
                    f"greedy labels from its stored top-{self.topk}")  # fmt: skip
        if self.final:
            return "its whole distribution (the final hidden states through the LM head)"
        return f"its top-{self.topk} (renormalized)" if self.topk else "none"


def target_source(
    path: Path, manifest: dict, needs: list[str], greedy: bool = False
) -> TargetSource:
    """Where the settings in `needs` (config.LossConfig.needs_target's) take the target's
    distribution from (`greedy`: train.loss.labels greedy among them); features holding neither
    source are refused, naming the manifest, the settings and the extract keys that provide one."""
    if not needs:
        return TargetSource()
    k = manifest.get("topk", 0)  # manifests written before soft targets existed lack it
    if manifest.get("final_hidden"):  # manifests written before it existed lack it
        # greedy labels take the stored top-1 where there is one: computed from the target's
        # own logits, where the final state's codec moves the argmax (fp8-zstd: 2.5% of
        # positions, fp4-zstd 6.8%, on SmolLM2: benchmarks/final_hidden_codec.py)
        return TargetSource(topk=k if greedy else 0, final=True)
    if k:
        return TargetSource(topk=k)
    raise DataError(
        f"{path}: the features have no top-k soft targets and no final hidden states (made with "
        f"extract.topk 0 and extract.final_hidden off), but {', '.join(needs)} trains on the "
        "target's distribution; extract with extract.final_hidden true (its whole distribution) "
        "or extract.topk > 0 (its top-k)"
    )


def extra_features(path: Path, own: dict, topk: int = 0) -> tuple[dict, list[Path]]:
    """(manifest, shard paths) of more features to train on (`train.extra_features`): they must
    come from the same target (weights and tokenizer) with the same layers, hidden size, codec
    and group size as the stage's own (a drafter trained on a mix of codecs would read inputs of
    two error levels; and, with soft targets, the same top-k), the final hidden states stored
    or not as in the own (a pack's rows have one width); their shards are the files of those
    names beside the manifest."""
    manifest = read_manifest(path)
    keys = ("layer_ids", "hidden_size", "codec", "group_size")
    try:
        check_manifest({"final_hidden": False} | manifest,  # absent before it existed
                       {key: own.get(key) for key in keys}
                       | {"final_hidden": own.get("final_hidden", False)}
                       | {f"target.{k}": own["target"].get(k)
                          for k in ("weights_sha256", "tokenizer_sha256")}
                       | ({"topk": topk} if topk else {}))  # fmt: skip
    except DataError as e:
        raise DataError(f"train.extra_features {path}: {e}") from None
    return manifest, [path.parent / Path(s["path"]).name for s in manifest["shards"]]


def features_digest(vouched: list[tuple[Path, dict]]) -> str:
    """What the shards trained on hold: their sha256s, as their manifests vouch for them."""
    sums = [next(s["sha256"] for s in m["shards"] if Path(s["path"]).name == p.name)
            for p, m in vouched]  # fmt: skip
    return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]
