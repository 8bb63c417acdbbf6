"""Tokenizer loading for a ModelSource, with an on-disk cache for tokenizers converted from GGUF.
Converting a GGUF vocabulary with transformers takes seconds, so the result is saved once per file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from spmd_runtime.protocol.model_source import ModelSource, config_source_kind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Classes that are plain tokenizer.json wrappers; these load without AutoTokenizer, which imports torch.
_GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_cache_dir() -> Path:
    """$XDG_CACHE_HOME (or ~/.cache) / spmd-runtime / tokenizers."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spmd-runtime" / "tokenizers"


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """Tokenizer of a model; for dummy sources the one of the config source, if it has one."""
    kind = config_source_kind(source)
    if kind == "preset":
        raise ValueError(f"model {source.name} has no tokenizer: pass token ids")
    if kind == "gguf":
        return _gguf_tokenizer(source.path)
    directory = Path(source.path) if kind == "hf" else Path(source.path).parent
    if not any((directory / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(f"model {source.name} has no tokenizer: pass token ids")
    return _load_saved(directory)


def _load_saved(directory: Path) -> PreTrainedTokenizerBase:
    """Load a saved tokenizer, torch-free when it is a generic tokenizer.json one (about 2 s faster)."""
    config_file = directory / "tokenizer_config.json"
    cls = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if cls in _GENERIC_FAST_CLASSES and (directory / "tokenizer.json").is_file():
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as fast_cls
        except ImportError:  # transformers < 5
            from transformers import PreTrainedTokenizerFast as fast_cls

        return fast_cls.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def gguf_chat_template(path: str) -> str | None:
    """The tokenizer.chat_template string stored in a GGUF file, if any."""
    import gguf

    field = gguf.GGUFReader(path, "r").fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def _gguf_cache_key(path: str) -> str:
    from transformers import __version__ as transformers_version

    st = os.stat(path)
    # The transformers version is part of the key: a saved tokenizer need not load in another version.
    ident = f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers_version}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    cache_root = tokenizer_cache_dir()
    cached = cache_root / _gguf_cache_key(path)
    if cached.is_dir():
        return _load_saved(cached)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if tok.chat_template is None:
        tok.chat_template = gguf_chat_template(path)
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_root)
    except OSError:
        return tok  # unwritable cache: still usable, just slow every time
    try:
        tok.save_pretrained(tmp)
        # Atomic publish: readers see either no directory or a complete one. If another
        # process published first, rename fails on the non-empty target and theirs is kept.
        os.rename(tmp, cached)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not cached.is_dir():
        return tok
    # Load back from the cache so the first call returns exactly what later calls will.
    return _load_saved(cached)
