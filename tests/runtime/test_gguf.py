"""GGUF files of the families beside Llama (runtime/loaders/gguf.py). Tiny random checkpoints are
written the way llama.cpp's converter writes them for their architecture (tensor names from the
gguf package's own map, float32, Q/K rows permuted for the llama architecture, which Mistral
converts to) and load to transformers' logits on the Hugging Face checkpoint, and to those
transformers computes from the GGUF file itself; the engine serves one at two ranks under
prefix caching, chunked prefill and preemption. Prompts are token ids: the files carry no
tokenizer. Gemma 2 and 3 are written with their norms as 1 + weight, as the converter does; their
files are checked against transformers on the Hugging Face checkpoint only (transformers' GGUF
reader takes neither their soft-caps nor Gemma 3's rope scaling and layer pattern from a file)."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from sharp_llama import (
    FAMILY_ENGINE,
    GREEDY,
    family_prompts,
    ranks_on_one_host,
    save_sharp,
    transformers_greedy,
)
from spmd_runtime.runtime import LLM
from spmd_runtime.runtime.layers.group_quant import KEPT_TYPES, GroupQuantWeight
from spmd_runtime.runtime.layers.parallel import TensorParallel
from spmd_runtime.runtime.loaders.gguf import load_gguf_model, read_gguf_config
from spmd_runtime.runtime.loaders.hf_dir import read_hf_config
from spmd_runtime.runtime.models import build_model
from test_model_families import NORM_CENTER, WINDOW, hf_checkpoint

# The GGUF architecture llama.cpp writes each family as.
ARCHITECTURES = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "mistral": "llama",
                 "gemma2": "gemma2", "gemma3": "gemma3"}


def hf_model(family: str):
    """A tiny transformers model of `family` (unsaved): test_model_families' checkpoint, but for
    what a GGUF cannot say to transformers' reader or to llama.cpp."""
    model_class, config = hf_checkpoint(family)
    if family == "qwen3":
        # transformers' GGUF reader ignores key_length: the head size must be its default.
        config.head_dim, config.attention_bias = 128, False
    if family in ("gemma2", "gemma3"):
        # No GGUF key carries the query scale: llama.cpp scales by head_dim ** -0.5 (as the
        # released models but the 27B ones), so these checkpoints do too.
        config.query_pre_attn_scalar = config.head_dim
    return model_class(config)


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for its llama architecture (rotary pairs interleaved)."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_metadata(writer: gguf.GGUFWriter, arch: str, config, token_list: bool) -> None:
    """The keys llama.cpp's converter writes for `arch` (convert_hf_to_gguf.py), but of the
    tokenizer only its special token ids and, with `token_list`, a list of placeholder tokens."""
    head_dim = config.to_dict().get("head_dim") or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if config.to_dict().get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
    if arch == "phi3":
        writer.add_sliding_window(config.sliding_window or 0)
    if arch in ("gemma2", "gemma3"):
        write_gemma_metadata(writer, arch, config)
    for token, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id)):
        if getattr(config, f"{token}_token_id", None) is not None:
            add(getattr(config, f"{token}_token_id"))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if token_list:
        # Where no vocab_size is written (every architecture but llama), transformers takes the
        # vocabulary's size from the token list.
        writer.add_token_list([f"<{i}>" for i in range(config.vocab_size)])


def write_gemma_metadata(writer: gguf.GGUFWriter, arch: str, config) -> None:
    """Gemma's keys beside the common ones: soft-caps, the window and, for Gemma 3, the full
    layers' rope scaling and the sliding layers' rope base. The converter writes no layer
    pattern for Gemma 3, and llama.cpp then makes every sixth layer the full one; these
    checkpoints' layer_types differ, so their files list which layers slide."""
    writer.add_sliding_window(config.sliding_window)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        return
    full, sliding = (config.rope_parameters[kind] for kind in ("full_attention", "sliding_attention"))
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base_swa(sliding["rope_theta"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])


def write_gguf(path: str, model, arch: str, token_list: bool = True,
               blocks: gguf.GGMLQuantizationType | None = None) -> str:
    """`model` as a float32 GGUF file of llama.cpp's `arch` (see write_metadata); with `blocks`,
    its projection and embedding weights in that block-quantized type."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    write_metadata(writer, arch, config, token_list)
    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1     # the factor Gemma's norms scale by, as the converter stores it
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if blocks is not None and name.endswith(("_proj.weight", "embed_tokens.weight")):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, blocks), raw_dtype=blocks)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    """(family, Hugging Face directory, its GGUF file, the transformers model)."""
    family, directory = request.param, tmp_path_factory.mktemp(request.param)
    directory, hf = save_sharp(directory, lambda: hf_model(family), NORM_CENTER.get(family, 1.0))
    return family, directory, write_gguf(f"{directory}/{family}.gguf", hf, ARCHITECTURES[family]), hf


def test_gguf_config_is_the_checkpoints(checkpoint) -> None:
    family, directory, path, _ = checkpoint
    expected = read_hf_config(directory)
    if family == "mistral":
        # llama.cpp converts Mistral as llama and writes no sliding window for it.
        expected = dataclasses.replace(expected, architecture="llama", sliding_window=None,
                                       sliding_layers=())
    config = read_gguf_config(path)
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)    # a float32 in GGUF
    assert dataclasses.replace(config, rms_norm_eps=expected.rms_norm_eps) == expected


def test_gguf_logits_equal_transformers(checkpoint) -> None:
    import transformers

    family, directory, path, hf = checkpoint
    config, weights = load_gguf_model(path, torch.float32)
    model = build_model(config, torch.float32)
    model.load_hf_state_dict(weights)
    ids = family_prompts()[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    diff = float((model.eval().prompt_logits(ids) - expected).abs().max())
    print(f"{family} GGUF: max |logit difference| {diff:.2e}")
    assert diff < 1e-4
    if family in ("gemma2", "gemma3"):
        return
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=path.rsplit("/", 1)[1], dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = from_gguf(torch.tensor([ids])).logits[0]
    # transformers reads the file as llama.cpp's layout too: the same model (but for Phi-3's
    # sliding window, which its GGUF reader drops: compared where the window does not act).
    positions = WINDOW if family == "phi3" else len(ids)
    assert float((theirs - expected)[:positions].abs().max()) < 1e-4


# The kept types gguf-py can write (not the K-quants: test_group_quant.py decodes those).
@pytest.mark.parametrize("blocks", [t for t in KEPT_TYPES if not t.name.endswith("_K")])
@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_blocks_kept_quantized_are_the_dequantised_weights(family, blocks, tmp_path) -> None:
    """--quantization gguf's load (keep_quantized): Mistral, llama.cpp's llama architecture (Q/K
    rows permuted), and Phi-3 (QKV and gate/up stacked in the file) give the dequantised load's
    logits, float32, and every tensor-parallel rank's shard of each projection is the
    dequantised model's (Mistral's 48 output-projection columns a rank split blocks: expanded)."""
    hf = hf_model(family)
    path = write_gguf(str(tmp_path / f"{family}.gguf"), hf, ARCHITECTURES[family],
                      token_list=False, blocks=blocks)
    config, dense = load_gguf_model(path, torch.float32)
    _, kept = load_gguf_model(path, torch.float32, keep_quantized=True)
    assert sum(isinstance(w, GroupQuantWeight) for w in kept.values()) == 2 * 7 + 1
    models = []
    for weights, tp in ((dense, TensorParallel()), (kept, TensorParallel())):
        models.append(build_model(config, torch.float32, tp))
        models[-1].load_hf_state_dict(dict(weights))
    ids = family_prompts()[2]
    torch.testing.assert_close(models[1].eval().prompt_logits(ids),
                               models[0].eval().prompt_logits(ids), rtol=1e-5, atol=1e-4)
    for rank in range(2):
        shards = [build_model(config, torch.float32, TensorParallel(rank, 2)) for _ in range(2)]
        shards[0].load_hf_state_dict(dict(dense))
        shards[1].load_hf_state_dict(dict(kept))
        for (module, name), (kept_module, _) in zip(shards[0].projection_slots(),
                                                     shards[1].projection_slots(), strict=True):
            weight = getattr(kept_module, name)     # expanded where a shard splits blocks
            expanded = weight.expand() if isinstance(weight, GroupQuantWeight) else weight
            assert torch.equal(expanded, getattr(module, name))
        assert torch.equal(shards[1].embed_tokens.expand(), shards[0].embed_tokens)


def test_a_type_without_a_kernel_is_dequantised_with_a_line_naming_it(tmp_path, caplog) -> None:
    hf = hf_model("qwen2")
    path = write_gguf(str(tmp_path / "mxfp4.gguf"), hf, "qwen2", token_list=False,
                      blocks=gguf.GGMLQuantizationType.MXFP4)
    with caplog.at_level("INFO", logger="spmd.loader"):
        _, weights = load_gguf_model(path, torch.float32, keep_quantized=True)
    assert not any(isinstance(w, GroupQuantWeight) for w in weights.values())
    (line,) = [r.getMessage() for r in caplog.records if "dequantised" in r.getMessage()]
    assert line.endswith("mxfp4.gguf: 15 MXFP4 tensors dequantised to float32 (no kernel keeps "
                         "these types quantized)"), line


def test_longrope_factors_are_refused(tmp_path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "phi3")
    write_metadata(writer, "phi3", hf_model("phi3").config, token_list=False)
    writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="longrope"):
        read_gguf_config(str(tmp_path / "long.gguf"))


@pytest.mark.timeout(300)
def test_engine_serves_a_phi3_gguf_at_two_ranks(tmp_path) -> None:
    directory, hf = save_sharp(tmp_path, lambda: hf_model("phi3"))
    # Without a token list the engine does not try to build a tokenizer from the file.
    path = write_gguf(f"{directory}/phi3.gguf", hf, "phi3", token_list=False)
    with LLM(path, **ranks_on_one_host(2), **FAMILY_ENGINE) as llm:
        outputs = llm.generate(family_prompts(), GREEDY)
        stats = llm.client.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert [o.token_ids for o in outputs] == [transformers_greedy(hf, p) for p in family_prompts()]


def released_gemma_metadata(path: str, arch: str, layers: int, hidden: int, heads: int,
                            window: int | None) -> str:
    """A tensorless GGUF with the keys the converter writes for a released Gemma model (and
    nothing llama.cpp defaults: no caps, layer pattern or sliding rope base)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(4 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_key_length(256)
    writer.add_value_length(256)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    if window:
        writer.add_sliding_window(window)
    writer.add_token_list(["<0>", "<1>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_gemma_gguf_defaults_are_llama_cpps(tmp_path) -> None:
    """What llama.cpp assumes where the file is silent: Gemma 3's every sixth layer full and a
    sliding rope base of 10000, Gemma 2's caps of 50 and 30 and window of 4096 on its even
    layers; queries scaled by head_dim, but by hidden / heads for the 27B models (told by their
    layer count). The windows leave the full context."""
    gemma3 = read_gguf_config(released_gemma_metadata(str(tmp_path / "g3.gguf"), "gemma3",
                                                      26, 1152, 4, window=512))
    assert gemma3.architecture == "gemma3_text" and gemma3.tie_word_embeddings
    assert gemma3.sliding_layers == tuple(i for i in range(26) if i not in (5, 11, 17, 23))
    assert (gemma3.sliding_rope_theta, gemma3.rope_theta, gemma3.max_position_embeddings,
            gemma3.sliding_window) == (1e4, 1e6, 8192, 512)
    assert (gemma3.query_pre_attn_scalar, gemma3.attn_logit_softcapping,
            gemma3.final_logit_softcapping) == (256, None, None)
    no_window = read_gguf_config(released_gemma_metadata(str(tmp_path / "g3full.gguf"),
                                                         "gemma3", 26, 1152, 4, window=None))
    assert (no_window.sliding_layers, no_window.sliding_rope_theta,
            no_window.max_position_embeddings) == ((), None, 8192)
    gemma2 = read_gguf_config(released_gemma_metadata(str(tmp_path / "g2.gguf"), "gemma2",
                                                      46, 4608, 32, window=None))
    assert (gemma2.query_pre_attn_scalar, gemma2.attn_logit_softcapping,
            gemma2.final_logit_softcapping, gemma2.max_position_embeddings,
            gemma2.sliding_window) == (144, 50, 30, 8192, 4096)
    assert gemma2.hidden_activation == "gelu_pytorch_tanh"
    assert gemma2.sliding_layers == tuple(range(0, 46, 2))
