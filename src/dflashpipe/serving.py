"""The launch lines that serve a run's drafter in SGLang and vLLM (and llama.cpp for a DFlash2
drafter), filled in for its export and target (report.md's "Serve the drafter"; the README's
section gives the same lines).

    eval/metrics.json's drafter (path, block size) and target ─► SGLang and vLLM lines
    the export's config.json (architectures, layer types),   ─► notes under them; DFlash2:
    mask_embedding.pt                                            the llama.cpp lines too
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

# A DFlash2 export (config.json architectures ["DFlash2DraftModel"]), as the engines' sources read
# (none run here; docs/dflash2.md "Serving" names files and commits). SGLang: no flag of its own;
# --speculative-algorithm DFLASH with the same draft flags (arg_groups/speculative_hook.py
# _handle_dflash); a DFlash2DraftModel class was not in the models/dflash.py read. vLLM: method
# "dflash" (config/speculative.py), the architecture picks DFlash2Qwen3ForCausalLM
# (model_executor/models/qwen3_dflash2.py) and forces the V2 model runner (config/vllm.py
# _is_dflash2_draft); its convolutions take the block as 1 + num_speculative_tokens. llama.cpp:
# a GGUF from convert_hf_to_gguf.py (--target-model-dir required, conversion/qwen.py DFlashModel),
# then --spec-type draft-dflash --spec-draft-model (common/arg.cpp); a `dflash.selector_top_k`
# above 0 in the GGUF selects DFlash2 (common/speculative.cpp), --spec-draft-n-max is clamped to
# the block size - 1; the conversion/qwen.py read registers DFlashDraftModel only.
DFLASH2 = "DFlash2DraftModel"


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


def _dflash2_lines(path: str, block: int, target: str) -> str:
    """The DFlash2 notes and llama.cpp lines under the SGLang and vLLM ones: both take the export
    with DFlash's flags, llama.cpp a GGUF of it that its converter makes."""
    gguf = target.endswith(".gguf")
    model = shlex.quote(target) if gguf else "<target GGUF>"
    target_dir = "<target HF directory>" if gguf else shlex.quote(target)
    quoted = shlex.quote(path)
    return f"""
DFlash2 (`{DFLASH2}`): SGLang and vLLM take it with DFlash's flags above and pick the
architecture from its `config.json`. vLLM runs its selector on the V2 model runner (chosen for this
architecture; `VLLM_USE_V2_MODEL_RUNNER=0` would draft without it), needs an unquantized target
LM head, and reads the convolutions' block as 1 + `num_speculative_tokens`, so the value above
matters twice. SGLang's flags are those of DFLASH; its DFlash2 loader was not found in the source
read. None of these pairings was run here.

llama.cpp (a GGUF of the drafter; `--spec-draft-n-max` = block size {block} - 1; its loader reads
DFlash2, but the converter read registers `DFlashDraftModel` only, so this step is unverified):
```
python convert_hf_to_gguf.py {quoted} --outfile drafter.gguf --target-model-dir {target_dir}
llama-server -m {model} --spec-type draft-dflash --spec-draft-model drafter.gguf \\
    --spec-draft-n-max {block - 1}
```
"""


def serving(evaluation: dict) -> str:
    """The README's "Serve the drafter" launch lines filled in for this run's drafter and target
    (paths as evaluate recorded them, relative to the run's directory); '' for metrics written
    before they recorded the drafter. vLLM does not read block_size from the drafter's
    config.json: num_speculative_tokens must be block_size - 1, or it drafts a length the drafter
    never trained on, without an error. A GGUF target adds the flags that keep the drafter's
    own load format (GGUF_FLAGS, `draft_load_config`); a DFlash2 export adds its notes and the
    llama.cpp lines (DFLASH2)."""
    drafter, target = evaluation.get("drafter"), evaluation.get("target")
    if not drafter or not target:
        return ""
    path, block = drafter["path"], drafter["block_size"]
    gguf = target.endswith(".gguf")
    config = {"method": "dflash", "model": path, "num_speculative_tokens": block - 1}
    spec = json.dumps(config | ({"draft_load_config": {"load_format": "auto"}} if gguf else {}))
    sglang_gguf = f" \\\n    {GGUF_FLAGS}" if gguf else ""
    notes, dflash2 = [], ""
    exported = Path(path) / "config.json"
    if exported.is_file():
        exported_config = json.loads(exported.read_text(encoding="utf-8"))
        types = set(exported_config.get("layer_types") or [])
        if len(types) > 1:
            notes.append("- its layers mix sliding-window and full attention: vLLM serves such a "
                         "drafter with `VLLM_USE_V2_MODEL_RUNNER=1` only")  # fmt: skip
        if DFLASH2 in (exported_config.get("architectures") or []):
            dflash2 = _dflash2_lines(path, block, target)
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
{dflash2}""" + "\n".join(notes)
