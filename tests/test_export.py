"""Export in the published DFlash layout and load it back."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, Qwen3Config

from dflashpipe.errors import DataError
from dflashpipe.export import ARCHITECTURES, load_drafter, save_drafter
from dflashpipe.model import Drafter, DrafterConfig

V, H, MASK = 96, 32, 95
SCALED_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}


def drafter(learned_mask: bool = False, **layout) -> Drafter:
    """Two layers, the first with a window of 5; `layout` overrides num_layers, layer_types and
    sliding_window."""
    target = LlamaConfig(
        num_hidden_layers=8,
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        intermediate_size=48,
        rope_parameters=dict(SCALED_ROPE),
    )
    kw = dict(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    config = DrafterConfig.from_target(
        target,
        mask_token_id=MASK,
        block_size=4,
        target_layer_ids=[1, 5],
        learned_mask_embedding=learned_mask,
        **(kw | layout),
    )
    torch.manual_seed(0)
    d = Drafter(config, torch.randn(V, H), torch.randn(V, H))
    with torch.no_grad():  # norms start at ones; make them matter for the round trip
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def forward(d: Drafter) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    T = 16
    with torch.no_grad():
        return d(
            torch.randint(0, MASK, (T,), generator=g),
            torch.randn(T, 2 * H, generator=g).to(d.fc.weight.dtype),
            torch.arange(T),
            torch.zeros(T, dtype=torch.long),
            torch.tensor([2, 6, 11]),
            torch.ones(3, dtype=torch.bool),
        )


def expected_names(n_layers: int) -> set[str]:
    per_layer = (
        [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        + [f"self_attn.{p}_norm.weight" for p in "qk"]
        + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        + ["input_layernorm.weight", "post_attention_layernorm.weight"]
    )
    layers = {f"layers.{i}.{n}" for i in range(n_layers) for n in per_layer}
    return layers | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_round_trip_gives_identical_outputs(tmp_path):
    d = drafter()
    save_drafter(d, tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter", d.embed_tokens.weight, d.lm_head.weight)
    assert torch.equal(forward(loaded), forward(d))
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # no temporary files left behind


def test_files_use_the_published_names_and_fields(tmp_path):
    d = drafter()
    save_drafter(d, tmp_path, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (H, 2 * H)
        assert f.get_tensor("norm.weight").dtype == torch.bfloat16
    assert names == expected_names(2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["mask_token_id"] == MASK
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 5]
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"]) == (4, 8, 2)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert (cfg["sliding_window"], cfg["tie_word_embeddings"]) == (5, False)
    assert cfg["torch_dtype"] == "bfloat16" and cfg["head_dim"] == H // 4
    assert cfg["rope_parameters"] == SCALED_ROPE and cfg["rope_theta"] == 20000.0
    assert cfg["rope_scaling"] == SCALED_ROPE
    # transformers itself reads it as the Qwen3 model it claims to be.
    q = Qwen3Config.from_dict(cfg)
    assert q.rope_parameters == SCALED_ROPE and q.layer_types == cfg["layer_types"]
    assert (q.num_key_value_heads, q.intermediate_size, q.sliding_window) == (2, 48, 5)


def test_bf16_export_loads_as_the_bf16_model(tmp_path):
    d = drafter()
    save_drafter(d, tmp_path, dtype=torch.bfloat16)
    loaded = load_drafter(tmp_path, d.embed_tokens.weight, d.lm_head.weight)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(forward(loaded), forward(d.to(torch.bfloat16)))


def test_a_window_from_drafter_sliding_window_round_trips(tmp_path):
    """sliding_window alone (no layer_types): every layer but the last slides, in the config the
    engines read, and the loaded drafter has the same layers and outputs."""
    d = drafter(num_layers=3, layer_types=None, sliding_window=3)
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (cfg["use_sliding_window"], cfg["sliding_window"]) == (True, 3)
    loaded = load_drafter(tmp_path, d.embed_tokens.weight, d.lm_head.weight)
    assert loaded.config.layer_types == d.config.layer_types
    assert [layer.self_attn.sliding_window for layer in loaded.layers] == [3, 3, None]
    assert torch.equal(forward(loaded), forward(d))
    full = drafter(num_layers=3, layer_types=None, sliding_window=None)
    full.load_state_dict(d.state_dict())
    assert not torch.equal(forward(full), forward(d))  # the window is in the served drafter


def test_learned_mask_embedding_is_saved_only_when_learned(tmp_path):
    d = drafter(learned_mask=True)
    with torch.no_grad():
        d.mask_embedding.add_(1.0)
    save_drafter(d, tmp_path, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == expected_names(2) | {"mask_embedding"}
    loaded = load_drafter(tmp_path, d.embed_tokens.weight, d.lm_head.weight)
    assert torch.equal(forward(loaded), forward(d.to(torch.bfloat16)))
    # and where SGLang and vLLM read it: torch.load(weights_only=True), a flat (H,) vector
    state = torch.load(tmp_path / "mask_embedding.pt", weights_only=True)
    assert set(state) == {"embedding", "mask_token_id"}
    assert type(state["mask_token_id"]) is int and state["mask_token_id"] == MASK
    assert state["embedding"].shape == (H,) and state["embedding"].dtype == torch.bfloat16
    assert torch.equal(state["embedding"], d.mask_embedding.detach())
    save_drafter(drafter(), tmp_path)  # a drafter without one, exported over it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_missing_or_foreign_files_are_named(tmp_path):
    with pytest.raises(DataError, match="config.json is missing"):
        load_drafter(tmp_path, torch.zeros(V, H), torch.zeros(V, H))
    d = drafter()
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="lack DFlashDraftModel"):
        load_drafter(tmp_path, d.embed_tokens.weight, d.lm_head.weight)


def dflash2_drafter() -> Drafter:
    """drafter() as DFlash2 with the default sizes (kernel 2, groups of 16, rank 256, top 16),
    its convolutions and selector off their initial values."""
    d = drafter(architecture="dflash2")
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.normal_(0.0, 0.3)
    return d


def test_dflash2_export_follows_the_official_contract(tmp_path):
    d = dflash2_drafter()
    save_drafter(d, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}  # noqa: SIM118
    conv = {f"layers.{i}.{c}_conv.{n}": s for i in range(2) for c in ("attention", "mlp")
            for n, s in (("base_kernel", (2, 2, H)), ("kernel_projection.weight", (2 * 2 * H // 16, H)))}  # fmt: skip
    selector = {
        "candidate_selector.predecessor_codebook": (V, 256),  # bare tensors, no ".weight"
        "candidate_selector.successor_codebook": (V, 256),
        "candidate_selector.hidden_projection.weight": (256, H),
    }
    assert set(shapes) == expected_names(2) | set(conv) | set(selector)
    assert {k: shapes[k] for k in conv | selector} == conv | selector
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    fields = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    assert [cfg["dflash_config"][k] for k in fields] == [2, 16, 256, 16]
    loaded = load_drafter(tmp_path, d.embed_tokens.weight, d.lm_head.weight)
    assert loaded.config == d.config
    assert torch.equal(forward(loaded), forward(d))
    for name, tensor in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "saved, claimed, message",
    [
        ("dflash2", "dflash", r"unexpected weights \['candidate_selector.hidden_projection"),
        ("dflash", "dflash2", r"missing weights \['layers.0.attention_conv.base_kernel'"),
    ],
)
def test_tensors_of_another_architecture_are_refused(tmp_path, saved, claimed, message):
    d = dflash2_drafter() if saved == "dflash2" else drafter()
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = [ARCHITECTURES[claimed]]
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                selector_top_k=4)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    refusal = f"safetensors: tensors do not match the {ARCHITECTURES[claimed]} of .*config.json"
    with pytest.raises(DataError, match=f"{refusal}: .*{message}"):
        load_drafter(tmp_path, d.embed_tokens.weight, d.lm_head.weight)


def test_dflash2_fields_are_required_of_a_dflash2_config(tmp_path):
    save_drafter(dflash2_drafter(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["dflash_config"]["selector_top_k"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DataError, match="config.json: missing key 'selector_top_k'"):
        load_drafter(tmp_path, torch.zeros(V, H), torch.zeros(V, H))


def test_a_scaled_input_embedding_is_declared_for_the_official_loop(tmp_path):
    """The official loop embeds the block as raw rows x dflash_config.input_embedding_scale
    (default 1); engines call the target's embedding module, which scales (Gemma: sqrt(H))."""
    d = drafter()
    save_drafter(d, tmp_path)
    assert (
        "input_embedding_scale"
        not in json.loads((tmp_path / "config.json").read_text())["dflash_config"]
    )
    d.embed_scale = H**0.5
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dflash_config"]["input_embedding_scale"] == H**0.5
