from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2_GGUF

from dflashpipe import attention
from dflashpipe.config import TargetConfig
from dflashpipe.errors import DataError
from dflashpipe.target import load_target, load_tokenizer, target_identity, torch_dtype


def test_local_hf_directory(tiny_target_dir):
    cfg = TargetConfig(model=str(tiny_target_dir))
    model, tok = load_target(cfg, torch.device("cpu"))
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == attention.FOLDED  # target.attn_implementation: sdpa
    assert tok.eos_token == "<|im_end|>"


@pytest.fixture
def converted_smollm2(smollm2_cache, monkeypatch):
    """GGUF loads in this test find the run's conversion of SmolLM2 (smollm2_cache)."""
    import dflashpipe.storage as storage

    monkeypatch.setattr(storage, "CACHE_DIR", smollm2_cache)


def test_identity_is_stable_and_sensitive(tiny_target_dir, smollm2_dir, converted_smollm2):
    hf = TargetConfig(model=str(tiny_target_dir))
    tok = load_tokenizer(hf)
    a, b = target_identity(hf, tok), target_identity(hf, tok)
    assert a == b and len(a.weights_sha256) == 64
    gguf = TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    g = target_identity(gguf, load_tokenizer(gguf))
    assert g.weights_sha256 != a.weights_sha256
    assert g.tokenizer_sha256 == a.tokenizer_sha256  # same tokenizer, saved and reloaded
    assert g.chat_template_sha256 == a.chat_template_sha256
    assert g.name.endswith(SMOLLM2_GGUF)
    assert load_tokenizer(gguf).name_or_path == str(smollm2_dir / SMOLLM2_GGUF)  # for messages


def test_gguf_target_loads_and_answers(smollm2_dir, converted_smollm2):
    cfg = TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    model, tok = load_target(cfg, torch.device("cpu"))
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_dict=True,
        return_tensors="pt",
    )  # fmt: skip
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "4" in tok.decode(out[0, ids["input_ids"].shape[1] :])


def test_dtype_policy():
    cfg = TargetConfig(model="x")
    assert torch_dtype(cfg, torch.device("cpu")) == torch.float32
    assert torch_dtype(cfg, torch.device("cuda")) == torch.bfloat16
    assert (
        torch_dtype(TargetConfig(model="x", dtype="float16"), torch.device("cpu")) == torch.float16
    )


def test_missing_local_target_is_named():
    with pytest.raises(DataError, match="resources/nothing-here.*does not exist"):
        load_target(TargetConfig(model="resources/nothing-here"), torch.device("cpu"))


def test_a_conversion_parses_its_gguf_once(smollm2_dir):
    """Inside target.parsed_once every GGUFReader of one file is the same parsed reader (the
    conversion's four loads share one parse: Gemma 3's conversion 104 s -> 54 s); outside it,
    and again after an error inside it, each call parses afresh."""
    import gguf

    from dflashpipe.target import parsed_once

    path = smollm2_dir / SMOLLM2_GGUF
    original = gguf.GGUFReader
    with parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and "tokenizer.ggml.tokens" in first.fields
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError), parsed_once():
        raise RuntimeError("a failed load")
    assert gguf.GGUFReader is original and gguf.GGUFReader(path) is not first


def test_gguf_cache_matches_a_direct_gguf_load(smollm2_dir, smollm2_cache, converted_smollm2):
    """The converted directory (made by gguf_cache for the whole run: smollm2_cache) gives the
    GGUF's own weights, tokenizer and template (every weight, base model and LM head), and is
    shared by the next load, not made again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dflashpipe.target as target

    cfg = TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    direct = AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32, local_files_only=True
    )
    direct_tok = AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    model, tok = load_target(cfg, torch.device("cpu"))
    cached = target.gguf_cache(cfg)
    assert cached.parent == smollm2_cache / "gguf" and (cached / "model.safetensors").is_file()
    expected = direct.state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    base, _ = load_target(cfg, torch.device("cpu"), base_only=True)
    for key, value in base.state_dict().items():
        assert torch.equal(value, expected[f"model.{key}"]), key
    text = [{"role": "user", "content": "Write a haiku about shards. 🚀"}]
    assert tok.apply_chat_template(text, add_generation_prompt=True) == (
        direct_tok.apply_chat_template(text, add_generation_prompt=True)
    )
    assert target.tokenizer_sha256(tok) == target.tokenizer_sha256(direct_tok)
    assert target.chat_template_sha256(tok) == target.chat_template_sha256(direct_tok)
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    load_tokenizer(cfg)
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp  # not made again
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no temporary left


def test_gguf_loads_directly_when_the_cache_cannot_be_written(smollm2_dir, tmp_path, monkeypatch):
    import dflashpipe.storage as storage
    import dflashpipe.target as target

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setattr(storage, "CACHE_DIR", blocked)
    cfg = TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
    assert target.gguf_cache(cfg) is None
    tok = load_tokenizer(cfg)  # straight from the GGUF
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tiny_target_dir, tmp_path_factory) -> Path:
    """A 2-layer, hidden-64 gpt-oss (mixture of experts, sliding window, attention sinks; no SDPA
    attention in transformers) with seeded random weights and SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    out = tmp_path_factory.mktemp("gpt-oss")
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok.save_pretrained(out)
    config = GptOssConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(out)
    return out


def test_auto_attention_is_the_best_the_family_has(tiny_target_dir, tiny_gpt_oss_dir):
    """target.attn_implementation auto: the folded SDPA for Llama, eager for gpt-oss (which has
    no SDPA attention); the choice is in the target identity every output records. An explicit
    sdpa for gpt-oss is refused before its weights load, naming the key and the alternatives."""
    from dflashpipe.chat import CHAT
    from dflashpipe.errors import ConfigError
    from dflashpipe.target import attention_choice

    llama = TargetConfig(model=str(tiny_target_dir))
    assert llama.attn_implementation == "auto" and attention_choice(llama) == "sdpa"
    model, tok = load_target(llama, torch.device("cpu"))
    assert model.config._attn_implementation == attention.FOLDED
    identity = target_identity(llama, tok)
    assert (identity.attn_implementation, identity.prompt_format) == ("sdpa", CHAT)

    oss = TargetConfig(model=str(tiny_gpt_oss_dir))
    model, tok = load_target(oss, torch.device("cpu"))
    assert model.config._attn_implementation == "eager"
    assert target_identity(oss, tok).attn_implementation == "eager"
    ids = torch.tensor([tok("def f(x):")["input_ids"]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    for choice in ("sdpa", "hf_sdpa"):
        with pytest.raises(ConfigError, match=(
            rf"target\.attn_implementation '{choice}': the gpt_oss family \(GptOssForCausalLM\) "
            r"has no sdpa attention in transformers .*; expected auto \(here: eager\), eager, "
            r"flash_attention_2"
        )):  # fmt: skip
            load_target(TargetConfig(model=str(tiny_gpt_oss_dir), attn_implementation=choice),
                        torch.device("cpu"))  # fmt: skip
