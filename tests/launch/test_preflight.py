"""runtime.preflight: what is checked before any process loads weights, torch-free, each
problem one line saying what to change."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.runtime.preflight import ConfigError, check_config

TINY = "dummy:tiny-llama"          # 4 attention heads, 2 key/value heads, 128 MLP features


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds for the test."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def held_after_a_free_port(holder: socket.socket) -> int:
    """Bind `holder` (listening) to a port whose predecessor is free just now (a process of
    another test may hold any port): the port, for checks that take its predecessor too."""
    for _ in range(50):
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1] + 1
            holder.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            probe.close()
        holder.listen()
        return port
    raise RuntimeError("no free port followed by a free port on 127.0.0.1")


def _problem(**options) -> str:
    with pytest.raises(ConfigError) as raised:
        check_config(EngineConfig(**options))
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_valid_config_passes() -> None:
    check_config(EngineConfig(model=TINY, nproc_per_node=2, rpc_address="ipc:///tmp/x"))
    check_config(EngineConfig(model=TINY, nproc_per_node=4, rpc_address="ipc:///tmp/x"))


def test_values_the_constructor_does_not_check() -> None:
    """EngineConfig(...) (what LLM(...) builds) checks no types, ranges or choices."""
    assert _problem(model=TINY, dtype="fp16") == (
        "invalid --dtype: invalid enum value 'fp16' (choose from auto, float32, float16, "
        "bfloat16)")
    assert "invalid --max-num-seqs: expected int >= 1, got 0" in _problem(model=TINY,
                                                                          max_num_seqs=0)


def test_gguf_quantization_needs_a_gguf_file() -> None:
    assert _problem(model=TINY, quantization="gguf") == (
        "--quantization gguf keeps a .gguf file's quantized blocks, and dummy:tiny-llama is not "
        "a GGUF file: use --quantization none or int8")
    check_config(EngineConfig(model="smollm2", quantization="gguf", rpc_address="ipc:///tmp/x"))


def test_a_gguf_file_that_is_not_one_or_is_cut_short_gets_one_line(tmp_path) -> None:
    from spmd_runtime.protocol.model_source import embedded_gguf_path

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model")
    assert _problem(model=str(garbage)) == f"{garbage}: not a GGUF file (no GGUF magic)"
    cut = tmp_path / "cut.gguf"
    with open(embedded_gguf_path(), "rb") as whole:
        cut.write_bytes(whole.read(50_000_000))
    assert _problem(model=str(cut)).startswith(f"{cut}: truncated GGUF file: tensor 'blk.")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(cut.read_bytes()[:1000])
    assert _problem(model=str(header_only)) == f"{header_only}: truncated GGUF file"


def test_models_that_are_not_there(tmp_path) -> None:
    assert "GGUF file not found" in _problem(model=str(tmp_path / "model.gguf"))
    assert "model path not found" in _problem(model=str(tmp_path / "no-such-dir"))
    hub = _problem(model="meta-llama/Llama-3.2-1B")
    assert "nothing is downloaded: pass a local .gguf file or directory" in hub
    assert "unknown model 'llama'" in _problem(model="llama")


def test_a_config_json_that_cannot_be_read(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert _problem(model=str(tmp_path)) == (
        f"cannot read the model config of {tmp_path} (missing 'num_attention_heads'): fix it or "
        "pass another --model")


def test_architectures_the_engine_does_not_build(tmp_path) -> None:
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 4, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps({**shape, "model_type": "gemma"}))
    message = _problem(model=str(tmp_path))
    assert "architecture 'gemma' is not supported: supported architectures are llama " \
           "(LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), phi3 " \
           "(Phi3ForCausalLM), mistral (MistralForCausalLM), gemma2 (Gemma2ForCausalLM), " \
           "gemma3_text (Gemma3ForCausalLM)" \
           in message
    # A family computes its own MLP activation: a Llama asking for another is refused.
    (tmp_path / "config.json").write_text(json.dumps(
        {**shape, "model_type": "llama", "hidden_act": "gelu_pytorch_tanh"}))
    assert "unsupported hidden_act 'gelu_pytorch_tanh': llama models are built with silu MLPs" \
        in _problem(model=str(tmp_path))
    # Layers named sliding with no window to slide.
    (tmp_path / "config.json").write_text(json.dumps(
        {**shape, "model_type": "qwen2", "layer_types": ["sliding_attention"]}))
    assert "layer_types names sliding_attention layers but sliding_window is not set" \
        in _problem(model=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(
        {**shape, "model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
    assert "rope scaling type 'longrope' is not implemented" in _problem(model=str(tmp_path))


def test_tensor_parallel_sizes_the_heads_do_not_split_into() -> None:
    message = _problem(model=TINY, nproc_per_node=3)
    assert message.startswith("tensor-parallel size 3 must divide the 4 attention heads of "
                              "dummy:tiny-llama (world size 3 = --nproc-per-node 3 x --nnodes 1)")
    assert message.endswith("use a tensor-parallel size (-tp) of 1, 2, 4")
    # Across nodes the world size counts: 3 x 2 does not divide 4 either.
    assert "world size 6" in _problem(model=TINY, nproc_per_node=3, nnodes=2, master_port=1,
                                      node_rank=1)


def test_model_configs_are_read_without_torch() -> None:
    code = ("import sys\n"
            "from spmd_runtime.protocol.config import EngineConfig\n"
            "from spmd_runtime.runtime.preflight import check_config\n"
            "check_config(EngineConfig(model='dummy:llama-3.2-1b', nproc_per_node=2))\n"
            "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_ports_in_use_on_node_0(taken_port, free_port) -> None:
    address = f"tcp://127.0.0.1:{taken_port}"
    assert _problem(model=TINY, rpc_address=address) == (
        f"--rpc-address {address}: port {taken_port} is already in use on this machine "
        "(another server?): pick a free port, or stop what holds it")
    private = {"model": TINY, "rpc_address": "ipc:///tmp/spmd-preflight-test"}
    assert _problem(**private, http_port=taken_port).startswith(f"--http-port {taken_port}: ")
    assert _problem(**private, master_port=taken_port).startswith(
        f"--master-port {taken_port}: ")
    # Across nodes the scheduler's worker socket is master port + 1.
    with socket.socket() as holder:
        above_free = held_after_a_free_port(holder)
        assert "the scheduler's worker socket" in _problem(**private, nnodes=2,
                                                            master_port=above_free - 1)
    port = free_port()
    assert _problem(model=TINY, rpc_address=f"tcp://127.0.0.1:{port}", http_port=port) == (
        f"--http-port {port} and --rpc-address tcp://127.0.0.1:{port} both use port {port}: "
        "give them different ports")


def test_ports_that_are_not_bound_are_not_checked(taken_port) -> None:
    address = f"tcp://127.0.0.1:{taken_port}"
    # A launcher that talks to its engine privately does not bind --rpc-address ...
    check_config(EngineConfig(model=TINY, rpc_address=address), serves_rpc=False)
    # ... and node 0's ports are node 0's business.
    check_config(EngineConfig(model=TINY, nnodes=2, node_rank=1, master_port=taken_port))
    # 0 or * picks a free port when binding.
    check_config(EngineConfig(model=TINY, rpc_address="tcp://127.0.0.1:*"))


def _gguf_with_a_layer(path, tensor_type) -> str:
    """A GGUF file of one layer weight of `tensor_type` (F32 or Q8_0): all --quantization auto
    reads."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    values = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    if tensor_type is gguf.GGMLQuantizationType.F32:
        writer.add_tensor("blk.0.attn_q.weight", values)
    else:
        writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(values, tensor_type),
                          raw_dtype=tensor_type)
    writer.add_tensor("token_embd.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_quantization_auto_keeps_a_quantized_gguf_files_blocks_only(tmp_path) -> None:
    """auto: gguf for a GGUF file whose layers are in kept block types (the embedded SmolLM2's
    Q4_1), none for an unquantized GGUF file, a Hugging Face directory or a dummy model; a
    concrete value stays as asked. The reason says which."""
    import gguf
    from spmd_runtime.runtime.preflight import resolved_quantization

    def resolved(**values) -> tuple[str, str]:
        config, why = resolved_quantization(EngineConfig(**values))
        return config.quantization, why

    assert EngineConfig().quantization == "auto"
    assert resolved(model="smollm2") == ("gguf", "auto: the file's layers are Q4_1 blocks, kept as they are")
    q8 = _gguf_with_a_layer(tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert resolved(model=q8) == ("gguf", "auto: the file's layers are Q8_0 blocks, kept as they are")
    f32 = _gguf_with_a_layer(tmp_path / "f32.gguf", gguf.GGMLQuantizationType.F32)
    assert resolved(model=f32) == ("none", "auto: the file is not quantized")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}))
    assert resolved(model=str(tmp_path / "hf"))[0] == "none"
    assert resolved(model="dummy:llama-3.2-1b")[0] == "none"
    assert resolved(model="smollm2", quantization="none") == ("none", "asked for with --quantization")
