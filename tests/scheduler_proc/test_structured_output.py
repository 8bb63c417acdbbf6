"""The scheduler's side of structured outputs: constraints compiled once (cached by text),
matchers advanced by sampled tokens, masks of what may come next, errors that name the field.
Torch-free, as the scheduler process is."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from spmd_runtime.protocol.sampling import StructuredOutput
from spmd_runtime.runtime.loaders import resolve_model
from spmd_runtime.scheduler_proc.structured_output import ConstrainedRequests
from spmd_runtime.scheduler_proc.tokenizer import load_tokenizer

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2"))


@pytest.fixture()
def constrained(tokenizer) -> ConstrainedRequests:
    requests = ConstrainedRequests()
    requests.configure(lambda: tokenizer, VOCAB, [tokenizer.eos_token_id])
    return requests


def allowed(mask: bytes) -> list[int]:
    words = np.frombuffer(mask, dtype="<u4")
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:VOCAB]).tolist()


def test_a_choice_is_followed_token_by_token_to_its_end(constrained, tokenizer) -> None:
    constrained.add(1, constrained.check(StructuredOutput(choice=("yes", "no"))))
    (request_id, mask), = constrained.masks([1, 2])         # request 2 is free: no mask
    assert request_id == 1
    first = allowed(mask)
    assert first and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in first)
    yes = tokenizer("yes", add_special_tokens=False).input_ids
    assert [constrained.accept(1, t) for t in yes][-1] is True   # complete after the last
    assert allowed(constrained.masks([1])[0][1]) == [tokenizer.eos_token_id]
    constrained.forget(1)
    assert not constrained


def test_each_constraint_compiles_once_and_every_request_gets_its_own_matcher(constrained) -> None:
    spec = StructuredOutput(regex=r"[0-9]{3}")
    first, second = constrained.check(spec), constrained.check(StructuredOutput(regex=r"[0-9]{3}"))
    assert first is not second
    assert len(constrained._compiler._templates) == 1


@pytest.mark.parametrize(("spec", "field"), [
    (StructuredOutput(json={"type": "nonsense"}), "structured_output.json"),
    (StructuredOutput(regex="(unclosed"), "structured_output.regex"),
    (StructuredOutput(grammar="start: undefined_rule"), "structured_output.grammar"),
    (StructuredOutput(json="[1, 2]"), "structured_output.json"),
])
def test_constraints_that_do_not_compile_are_refused_naming_the_field(constrained, spec, field) -> None:
    with pytest.raises(ValueError, match=field):
        constrained.check(spec)


def test_without_a_tokenizer_the_refusal_says_so() -> None:
    requests = ConstrainedRequests()

    def missing():
        raise ValueError("model dummy:tiny-llama has no tokenizer: pass token ids")

    requests.configure(missing, VOCAB, [0])
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        requests.check(StructuredOutput(json_object=True))


def test_exactly_one_constraint_per_request() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()


def test_structured_outputs_keep_the_scheduler_torch_free() -> None:
    code = ("import sys\nfrom spmd_runtime.scheduler_proc import structured_output, scheduler\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
