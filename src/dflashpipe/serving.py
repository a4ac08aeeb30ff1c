"""The launch lines that serve a run's drafter in SGLang and vLLM, filled in for its export and
target (report.md's "Serve the drafter"; the README's section gives the same lines).

    eval/metrics.json's drafter (path, block size) and target ─► SGLang and vLLM lines
    the export's config.json (layer types), mask_embedding.pt ─► notes under them
    a GGUF target                                              ─► the flags that keep the
                                                                  drafter's own load format
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

# A GGUF target, as the engines' sources read (neither pairing run here). SGLang: a .gguf
# --model-path switches --load-format and --quantization to gguf (python/sglang/srt/arg_groups/
# model_path_hook.py handle_load_format, arg_groups/overrides.py _gguf_quantization), config and
# tokenizer come from the file (utils/hf_transformers_utils.py get_config, get_tokenizer), and
# the drafter inherits both: managers/scheduler.py applies --speculative-draft-load-format only
# when given ("If not specified, will use the same format as --load-format"), and the draft's
# quantization defaults to the target's unless --speculative-draft-model-quantization is set
# ("unquant": none). vLLM: `vllm serve ./x.gguf --tokenizer <original HF repo>`, one file,
# recent versions through the vllm-gguf-plugin package (docs/features/quantization/gguf.md);
# a .gguf model sets load_format and quantization to gguf (vllm/engine/arg_utils.py
# create_model_config), and the drafter loads with the target's load config unless the
# speculative config's `draft_load_config` says otherwise (vllm/config/speculative.py).
GGUF_FLAGS = "--speculative-draft-load-format auto --speculative-draft-model-quantization unquant"


def _gguf_note(target: str) -> str:
    """What a GGUF target asks of each engine, above the launch lines ('' for other targets)."""
    if not target.endswith(".gguf"):
        return ""
    return (
        "The target is a GGUF file. SGLang takes it as `--model-path` and switches its load "
        "format and quantization to gguf, which the drafter inherits unless told otherwise: "
        f"hence `{GGUF_FLAGS}`. vLLM takes it as the model (one file; recent versions through "
        "the `vllm-gguf-plugin` package; `--tokenizer` naming the HF repo it was made from "
        "spares a slow conversion of its tokenizer) and loads the drafter with the target's "
        "load config unless `draft_load_config` says otherwise. Neither pairing was run here. "
        "The float32 HF directory dflashpipe converted the GGUF to (`$DFLASHPIPE_CACHE/gguf/`, "
        "default `~/.cache/dflashpipe/gguf/`, named by the GGUF's sha256) holds the weights "
        "this drafter trained and was evaluated against, and serves in either engine as any HF "
        "checkpoint, without those flags.\n"
    )


def serving(evaluation: dict) -> str:
    """The README's "Serve the drafter" launch lines filled in for this run's drafter and target
    (paths as evaluate recorded them, relative to the run's directory); '' for metrics written
    before they recorded the drafter. vLLM does not read block_size from the drafter's
    config.json: num_speculative_tokens must be block_size - 1, or it drafts a length the drafter
    never trained on, without an error. A GGUF target adds the flags that keep the drafter's
    own load format (GGUF_FLAGS, `draft_load_config`)."""
    drafter, target = evaluation.get("drafter"), evaluation.get("target")
    if not drafter or not target:
        return ""
    path, block = drafter["path"], drafter["block_size"]
    gguf = target.endswith(".gguf")
    config = {"method": "dflash", "model": path, "num_speculative_tokens": block - 1}
    spec = json.dumps(config | ({"draft_load_config": {"load_format": "auto"}} if gguf else {}))
    sglang_gguf = f" \\\n    {GGUF_FLAGS}" if gguf else ""
    notes = []
    exported = Path(path) / "config.json"
    if exported.is_file():
        types = set(json.loads(exported.read_text(encoding="utf-8")).get("layer_types") or [])
        if len(types) > 1:
            notes.append("- its layers mix sliding-window and full attention: vLLM serves such a "
                         "drafter with `VLLM_USE_V2_MODEL_RUNNER=1` only")  # fmt: skip
    if (Path(path) / "mask_embedding.pt").is_file():
        notes.append("- `mask_embedding.pt` beside it holds its learned mask embedding")
    return f"""## Serve the drafter
{_gguf_note(target)}SGLang:
```
python -m sglang.launch_server --model-path {shlex.quote(target)} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path {shlex.quote(path)} \\
    --speculative-num-draft-tokens {block}{sglang_gguf}
```
vLLM (num_speculative_tokens = block size {block} - 1):
```
vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}
```
""" + "\n".join(notes)
