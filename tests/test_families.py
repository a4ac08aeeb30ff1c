"""The family matrix (decoding/families.py): for each target family the static models cover, a
tiny random-weight target saved with save_pretrained and loaded as the stages load it, then
- the batched regenerate engine's greedy answers equal transformers' generate(),
- evaluate's engine (target-only, DFlash, DDTree, prompt lookup) equals the eager loop token for
  token in float32 (lossless), with no eager fallback,
- one verify forward over a tree (siblings at one position, the window measured in positions)
  gives the HF forward's logits on each path.

Llama is the control; the others carry what the engine must reproduce: Qwen3-MoE's sparse blocks,
Gemma 3's five sliding layers to one full (per-layer-type RoPE, scaled embedding, q/k norms,
four norms per layer, query_pre_attn_scalar, final soft-capping), Mistral's window on every
layer, Phi-3's fused projections (and a partial rotary factor, as Phi-4-mini has), gpt-oss's
experts, sinks and alternating windows. Every window (WINDOW) is shorter than prompt + answer.
"""

import json
import shutil
from collections import Counter

import pyarrow.parquet as pq
import pytest
import torch
import transformers as tf

import dflashpipe.decoding.ddtree  # noqa: F401 (registers the engine's "ddtree" steps)
from dflashpipe.config import TargetConfig
from dflashpipe.decoding.batched import BatchedEngine, Request
from dflashpipe.decoding.concurrent import ConcurrentEngine
from dflashpipe.decoding.eager import DFlashProposer, Target, greedy_decode, speculative_decode
from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.families import graph_safe_experts, layer_windows
from dflashpipe.decoding.hf_generate import generate_batch, generation_config
from dflashpipe.decoding.lookup import LookupConfig, PromptLookupProposer
from dflashpipe.decoding.runner import Decoders
from dflashpipe.decoding.static_models import StaticTarget
from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.target import load_target

WINDOW = 8
NEW = 16
MAX_LEN = 96
BLOCK = 4
TAPS = [0, 1]
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)  # fmt: skip
FAMILIES = {  # model_type -> (config class, what differs from SIZES)
    "llama": (tf.LlamaConfig, {}),
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(moe_intermediate_size=32, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True)),
    "gemma3_text": (tf.Gemma3TextConfig, dict(num_hidden_layers=6, sliding_window=WINDOW,
                                              final_logit_softcapping=30.0)),
    "mistral": (tf.MistralConfig, dict(sliding_window=WINDOW)),
    "phi3": (tf.Phi3Config, dict(sliding_window=WINDOW, partial_rotary_factor=0.5)),
    "gpt_oss": (tf.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=WINDOW, max_position_embeddings=131072)),
}  # fmt: skip
ATTENTION = {"gpt_oss": "eager"}  # transformers has no SDPA attention for gpt-oss (sinks)
TEXTS = ["def add(a, b):\n    return", "The capital of France is", "Once upon a time, there",
         "1, 2, 3, 4, 5, 6,", "Question: what is the boiling point of water? Answer:"]  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tiny_target_dir, tmp_path_factory):
    """A saved 4-layer (Gemma 3: 6, for one full layer to five sliding) hidden-64 target of the
    family with SmolLM2's tokenizer; matrices redrawn at std 0.3 (Gemma's embedding at 0.3 over
    its sqrt(H) scale, as its real rows are small) and gpt-oss's sinks at std 2, so greedy
    answers vary and every part changes them."""
    name = request.param
    out = tmp_path_factory.mktemp(name)
    shutil.copytree(tiny_target_dir, out, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "config.json"))  # fmt: skip
    ref = tf.AutoConfig.from_pretrained(tiny_target_dir)
    cls, extra = FAMILIES[name]
    config = cls(**{**SIZES, **extra}, vocab_size=ref.vocab_size, bos_token_id=ref.bos_token_id,
                 eos_token_id=ref.eos_token_id, pad_token_id=ref.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    embed = model.get_input_embeddings()
    scale = float(getattr(embed, "embed_scale", 1.0))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3 / scale if p is embed.weight else 0.3, generator=g)
            elif "sinks" in pname:
                p.normal_(0, 2.0, generator=g)
    model.save_pretrained(out)
    return name, out


@pytest.fixture(scope="module")
def target(family_dir):
    name, path = family_dir
    cfg = TargetConfig(model=str(path), attn_implementation=ATTENTION.get(name, "sdpa"))
    model, tok = load_target(cfg, torch.device("cpu"))
    assert model.config.model_type == name and model.dtype == torch.float32
    return model, tok


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    _, tok = target
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    """The eager loop's target-only greedy answers (the HF model with a DynamicCache)."""
    model, tok = target
    eager = Target(model)
    return [greedy_decode(eager, ids, NEW, {tok.eos_token_id}).output_ids for ids in prompts]


@pytest.fixture(scope="module")
def drafter(target, reference) -> Drafter:
    """A 1-layer drafter for the target whose LM head favours the token the target answers most
    often, so blocks are accepted in part and the verify's later rows count; the rest of its
    ranking is fixed (distinct logits), so DDTree's trees hold other tokens too."""
    model, _ = target
    config = DrafterConfig.from_target(model.config, mask_token_id=1, num_layers=1,
                                       block_size=BLOCK, target_layer_ids=TAPS)  # fmt: skip
    # not an answer's first token: that one comes from the prefill, never from a verify
    favourite = Counter(t for answer in reference for t in answer[1:]).most_common(1)[0][0]
    embed = model.get_input_embeddings().weight.detach()
    torch.manual_seed(1)
    d = Drafter(config, embed, embed.clone())
    with torch.no_grad():
        u = d.norm(d.embed_blocks(torch.tensor([[1]]))[0, 0])  # a mask slot's output, nearly
        rank = -torch.arange(config.vocab_size, dtype=u.dtype) / config.vocab_size
        rank[favourite] = 1.0
        d.lm_head.weight.copy_(rank[:, None] * u[None])
    return d.eval()


def test_the_families_have_what_the_matrix_tests(target):
    """Each target carries the feature its row is there for (a guard against a config default
    that would quietly leave it out)."""
    model, _ = target
    kind, windows = model.config.model_type, layer_windows(model.config)
    if kind in ("gemma3_text", "gpt_oss", "mistral", "phi3"):
        assert WINDOW in windows
    if kind in ("gemma3_text", "gpt_oss"):
        assert None in windows  # full layers among the sliding ones
    if kind == "gemma3_text":
        assert windows.count(WINDOW) == 5 * windows.count(None)
    if kind == "gpt_oss":
        assert model.model.layers[0].self_attn.sinks.abs().sum() > 0


@pytest.mark.parametrize("learned_mask", [False, True])
def test_the_drafter_embeds_its_block_as_the_target_does(target, learned_mask):
    """A serving engine embeds the drafter's block with the target's input embedding module
    (SGLang: get_input_embeddings()(block_ids)), Gemma 3's sqrt(hidden) scale included: the
    drafter trains and decodes on exactly that, a learned mask row starting from it."""
    model, _ = target
    config = DrafterConfig.from_target(model.config, mask_token_id=1, num_layers=1,
                                       block_size=BLOCK, target_layer_ids=TAPS,
                                       learned_mask_embedding=learned_mask)  # fmt: skip
    d = Drafter.from_target_model(config, model)
    ids = torch.tensor([[5, 1, 1, 1], [7, 1, 1, 1]])
    torch.testing.assert_close(d.embed_blocks(ids), model.get_input_embeddings()(ids))
    scaled = model.config.model_type == "gemma3_text"
    assert d.embed_scale == (pytest.approx(model.config.hidden_size**0.5) if scaled else 1.0)


def test_batched_engine_equals_generate(target, prompts):
    """Regenerate's engine: 5 prompts through 2 row slots (refills), greedy, answers past the
    window; generate() on left-padded batches with the family's own sliding caches."""
    model, tok = target
    stops = {tok.eos_token_id}
    gen = generation_config(_gen(NEW), stops, tok.eos_token_id, model.device, False)
    expected = generate_batch(model, prompts, gen, stops, len(prompts))
    engine = BatchedEngine(model, rows=2, capacity=MAX_LEN)
    requests = [Request(f"p{i}", ids) for i, ids in enumerate(prompts)]
    got = {a.index: (a.tokens, a.finish) for a in engine.generate(requests, NEW, stops)}
    assert [got[i] for i in range(len(prompts))] == [tuple(e) for e in expected]
    assert engine.stats["prefills"] >= 2  # rows were refilled
    # attention "flex": each row reads its own KV blocks (its window's, on sliding layers)
    if model.config.model_type == "gpt_oss":
        with pytest.raises(ValueError, match=r"'flex' does not take sink logits \(gpt_oss\)"):
            BatchedEngine(model, rows=2, capacity=MAX_LEN, attention="flex")
        return
    flex = BatchedEngine(model, rows=2, capacity=MAX_LEN, attention="flex")
    assert flex.capacity % 128 == 0 and flex.spans == [flex.capacity]
    got = {a.index: (a.tokens, a.finish) for a in flex.generate(requests, NEW, stops)}
    assert [got[i] for i in range(len(prompts))] == [tuple(e) for e in expected]


def _gen(max_new: int):
    from dflashpipe.config import RegenerateConfig

    return RegenerateConfig(max_new_tokens=max_new, cache="dynamic")


def test_engine_equals_the_eager_loop(target, prompts, reference, drafter):
    """Evaluate's decoders on the static engine (no fallback): target-only, DFlash, DDTree at two
    budgets and prompt lookup give the eager loop's tokens, DFlash and prompt lookup its
    acceptances, in float32."""
    model, tok = target
    stops = {tok.eos_token_id}
    lookup = LookupConfig(num_drafts=3, max_ngram_size=1)
    decoders = Decoders(model, drafter, ["dflash", "ddtree", "prompt_lookup"], "auto", MAX_LEN,
                        tree_nodes=[4, 12], tree_top_k=3, lookup=lookup)  # fmt: skip
    assert decoders.info()["kind"] == "static", decoders.info()
    eager, plain = Target(model, TAPS), Target(model)
    accepted = Counter()
    try:
        for ids, expected in zip(prompts, reference, strict=True):
            assert decoders.decode("target", ids, NEW, stops).output_ids == expected
            got = decoders.decode("dflash", ids, NEW, stops)
            ref = speculative_decode(eager, DFlashProposer(drafter), ids, NEW, stops)
            assert (got.output_ids, got.accepted_lengths) == (expected, ref.accepted_lengths)
            accepted.update(got.accepted_lengths)
            for method in ("ddtree@4", "ddtree@12"):
                assert decoders.decode(method, ids, NEW, stops).output_ids == expected
            got = decoders.decode("prompt_lookup", ids, NEW, stops)
            ref = speculative_decode(plain, PromptLookupProposer(3, 1), ids, NEW, stops)
            assert (got.output_ids, got.accepted_lengths) == (expected, ref.accepted_lengths)
    finally:
        eager.close()
        decoders.close()
    assert max(accepted) > 1  # whole verified blocks were accepted, not only bonus tokens


@pytest.mark.parametrize(("rows", "refill"), [(2, "step"), (8, "step"), (2, "pack")])
def test_concurrent_rows_equal_one_at_a_time(target, prompts, reference, drafter, rows, refill):
    """evaluate.concurrency's engine: the 5 prompts decoded `rows` at a time (2: rows refilled
    as answers end at different steps; 8: more rows than prompts, 3 idle) give, per prompt, the
    tokens of target-only greedy decoding and the c = 1 engine's acceptances, for target-only,
    DFlash and prompt lookup, in float32; refilled in the steps' own forwards (a refilled row
    idles in the step that prefills it) or in forwards of their own."""
    model, tok = target
    stops = {tok.eos_token_id}
    lookup = LookupConfig(num_drafts=3, max_ngram_size=1)
    engine = Engine(model, MAX_LEN, drafter)
    one = {"dflash": [engine.dflash(ids, NEW, stops) for ids in prompts],
           "prompt_lookup": [engine.lookup(ids, NEW, stops, PromptLookupProposer(3, 1))
                             for ids in prompts]}  # fmt: skip
    concurrent = ConcurrentEngine(engine, rows, refill=refill)
    steps = {}
    for method in ("target", "dflash", "prompt_lookup"):
        got, wall = concurrent.decode(method, prompts, NEW, stops, lookup)
        assert [d.output_ids for d in got] == reference, method
        assert wall > 0
        if method in one:
            assert [d.accepted_lengths for d in got] == [d.accepted_lengths for d in one[method]]
            assert [d.drafted for d in got] == [d.drafted for d in one[method]]
            steps[method] = {len(d.accepted_lengths) for d in got}
        if rows >= len(prompts):  # every prompt prefilled in one pack
            assert concurrent.prefills == 1, method
        assert (concurrent.prefill_s > 0) == (refill == "pack")  # apart, or in the steps
    assert len(steps["dflash"]) > 1  # rows finished at different steps
    with pytest.raises(ValueError, match="refill 'mixed': one of step, pack"):
        ConcurrentEngine(engine, rows, refill="mixed")


@pytest.mark.parametrize("refill", ["step", "pack"])
def test_refilled_rows_hold_the_prompts_caches(target, prompts, drafter, refill):
    """A refill writes each prompt's target K/V and drafter context at slots 0..P-1 of its row
    as the c = 1 engine's prefill does (float32), whether it rides in a step, in which the
    refilled rows idle and their idle writes land at those slots first, or runs apart. The
    test's drafter drafts the same whatever its context, so its tokens alone would not tell."""
    model, _ = target
    engine = Engine(model, MAX_LEN, drafter)
    want = []
    for ids in prompts:
        engine._prefill(ids, taps=True)
        P = len(ids)
        want.append((engine.target.kv[:, 0, :, :P].clone(), engine.drafter.kv[:, 0, :, :P].clone()))
    concurrent = ConcurrentEngine(engine, len(prompts), refill=refill)
    concurrent.decode("dflash", prompts, 2, set())  # prompt i in row i, one verify step each
    kv = torch.stack([*concurrent.k_all, *concurrent.v_all])
    # a slot written wrong or not at all is off by O(1); the pack's matmuls over all prompts'
    # tokens at once sum in another order than one prompt's prefill, which four std-0.3 layers
    # carry to ~2e-5 on a few of the last layer's keys
    for i, (ids, (target_kv, context)) in enumerate(zip(prompts, want, strict=True)):
        P = len(ids)
        torch.testing.assert_close(kv[:, i, :, :P], target_kv, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(concurrent.dkv[:, i, :, :P], context, rtol=1e-4, atol=5e-5)


def test_a_tree_verify_gives_the_hf_logits_of_each_path(target, prompts):
    """After the prompt (longer than the window), nodes a; b, c (siblings under a, one position,
    own slots); d under c, in one forward: each row's logits are the HF forward's on its path,
    so the windowed masks measure positions, not slots."""
    model, _ = target
    prefix = prompts[4]
    assert len(prefix) > WINDOW
    static = StaticTarget(model, 48)
    P = len(prefix)
    slots = torch.arange(P)
    static.forward(torch.tensor(prefix), slots, slots, torch.zeros(1, dtype=torch.long))
    a, b, c, d = 11, 12, 13, 14
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()
    logits, _ = static.forward(
        torch.tensor([a, b, c, d]),
        torch.tensor([P, P + 1, P + 1, P + 2]),  # positions
        torch.arange(P, P + 4),  # slots
        torch.tensor([P]),
        visible,
    )
    with torch.inference_mode():
        for row, path in enumerate([[a], [a, b], [a, c], [a, c, d]]):
            expected = model(input_ids=torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)


def test_the_stages_run_the_family_on_the_engine(family_dir, target, tmp_path):
    """regenerate (on the static engine, as `auto` picks it), extract, a 2-step train and export
    for the family; the exported drafter then decodes losslessly on the engine."""
    from dflashpipe.config import Config
    from dflashpipe.export import load_drafter
    from dflashpipe.extract import ExtractPaths
    from dflashpipe.extract import run as extract
    from dflashpipe.launcher import TrainPaths
    from dflashpipe.prompts import Prompt, prompt_key, write_prompts
    from dflashpipe.regenerate import RegeneratePaths
    from dflashpipe.regenerate import run as regenerate
    from dflashpipe.shards import build_manifest
    from dflashpipe.storage import write_json
    from dflashpipe.train import main as train

    name, path = family_dir
    raw = {
        "target": {"model": str(path), "attn_implementation": ATTENTION.get(name, "sdpa")},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"shards": 1, "batch_size": 4, "max_new_tokens": 12},
        "extract": {"max_length": 128, "token_budget": 256},
        "drafter": {"target_layer_ids": TAPS, "num_layers": 1, "block_size": BLOCK},
        "train": {"max_steps": 2, "max_length": 128, "num_anchors": 8, "log_every": 1, "gamma": 4,
                  "checkpoint_every": 2, "num_workers": 0},
    }  # fmt: skip
    msgs = [[{"role": "user", "content": t}] for t in TEXTS]
    write_prompts(tmp_path / "train.parquet", [Prompt(prompt_key(m), "t", str(i), 0, m, None, "f")
                                               for i, m in enumerate(msgs)])  # fmt: skip
    cfg = Config.from_dict(raw)
    regenerate(
        cfg, RegeneratePaths(str(tmp_path / "train.parquet"), 0, str(tmp_path / "seq.parquet"))
    )
    shard = tmp_path / "shard-00000.arrow"
    extract(cfg, ExtractPaths(str(tmp_path / "seq.parquet"), 0, str(shard)))
    write_json(tmp_path / "manifest.json", build_manifest([shard]))
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    train([TrainPaths(tmp_path / "c.yaml", tmp_path / "manifest.json", tmp_path / "run",
                      tmp_path / "drafter", tmp_path / "metrics.jsonl").to_json()])  # fmt: skip
    model, tok = target
    embed = model.get_input_embeddings().weight
    drafter = load_drafter(tmp_path / "drafter", embed, model.get_output_embeddings().weight)
    assert pq.read_table(tmp_path / "seq.parquet").schema.metadata[b"engine"] == b"static"
    decoders = Decoders(model, drafter, ["dflash"], "auto", MAX_LEN)
    try:
        ids = tok(TEXTS[0])["input_ids"]
        expected = decoders.decode("target", ids, NEW, set()).output_ids
        assert decoders.decode("dflash", ids, NEW, set()).output_ids == expected
    finally:
        decoders.close()


def test_experts_run_capturable_under_graphs(family_dir, prompts, reference):
    """Under CUDA graphs a mixture-of-experts target's experts switch to batched_mm (fixed
    shapes, no host sync, any dtype: transformers' grouped_mm would read group sizes back in
    float32) and still decode the reference; a dense target is left as it is."""
    name, path = family_dir
    cfg = TargetConfig(model=str(path), attn_implementation=ATTENTION.get(name, "sdpa"))
    model, tok = load_target(cfg, torch.device("cpu"))  # a fresh copy: the switch changes it
    switched = graph_safe_experts(model, graphs=True, compiled=True)
    if name not in ("qwen3_moe", "gpt_oss"):
        assert switched is None
        return
    assert switched == model.config._experts_implementation == "batched_mm"
    engine = Engine(model, MAX_LEN)
    for ids, expected in zip(prompts, reference, strict=True):
        assert engine.greedy(ids, NEW, {tok.eos_token_id}).output_ids == expected
