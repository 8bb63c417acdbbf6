"""Tokenizer tests: the cached GGUF tokenizer behaves exactly like transformers' direct GGUF conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spmd_runtime.runtime.loaders import resolve_model
from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer, tokenizer_cache_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXT = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def reference(hf_smollm2_tokenizer, smollm2_gguf):
    """transformers' direct GGUF conversion (AutoTokenizer.from_pretrained(gguf_file=...)) of
    the file "smollm2" resolves to: conftest's session tokenizer, converted once per run."""
    path = Path(resolve_model("smollm2").path)
    assert (path.parent, path.name) == smollm2_gguf
    return hf_smollm2_tokenizer


def _assert_same(tok, ref) -> None:
    ids = tok(TEXT).input_ids
    assert ids == ref(TEXT).input_ids
    assert tok.decode(ids) == ref.decode(ids) == TEXT
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert tok.chat_template == ref.chat_template
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]) == list(
        ref.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    )


def test_smollm2_tokenizer_cache_round_trip(tmp_path: Path, monkeypatch, reference) -> None:
    import transformers

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokenizer_cache_dir() == tmp_path / "xdg" / "spmd-runtime" / "tokenizers"
    source = resolve_model("smollm2")

    first = load_tokenizer(source)
    entries = list(tokenizer_cache_dir().iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file(), entries  # no leftover temp dirs
    assert reference.chat_template and "<|im_start|>" in reference.chat_template
    _assert_same(first, reference)

    def no_conversion(*args, **kwargs):
        raise AssertionError(f"tokenizer re-converted instead of read from cache: {args} {kwargs}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_conversion)
    second = load_tokenizer(source)
    _assert_same(second, reference)
    monkeypatch.undo()

    # The scheduler tokenizes; a cached tokenizer must load without importing torch.
    code = (
        "import sys\n"
        "from spmd_runtime.runtime.loaders import resolve_model\n"
        "from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer\n"
        f"ids = load_tokenizer(resolve_model('smollm2'))({TEXT!r}).input_ids\n"
        f"assert ids == {reference(TEXT).input_ids}, ids\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True)
    if child.returncode and "torch imported" in child.stderr and _transformers_imports_torch():
        pytest.skip(f"transformers {transformers.__version__} itself imports torch with its "
                    "tokenizer classes (5.17 does; 5.24 does not): nothing this engine can avoid")
    assert child.returncode == 0, child.stderr[-3000:]


def _transformers_imports_torch() -> bool:
    probe = ("import sys\nfrom transformers.tokenization_utils_tokenizers import TokenizersBackend\n"
             "print('torch' in sys.modules)")
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return child.stdout.strip() == "True"


def test_hf_and_dummy_tokenizers(tmp_path: Path, reference) -> None:
    with_tok = tmp_path / "with_tok"
    reference.save_pretrained(with_tok)
    (with_tok / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _assert_same(load_tokenizer(resolve_model(str(with_tok))), reference)
    _assert_same(load_tokenizer(resolve_model(f"dummy:{with_tok / 'config.json'}")), reference)

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model dummy:.*bare has no tokenizer: pass token ids"):
        load_tokenizer(resolve_model(f"dummy:{bare}"))
