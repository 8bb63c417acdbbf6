"""The scheduler's side of structured outputs: constraints compiled once (cached by text),
matchers advanced by sampled tokens, masks of what may come next, errors that name the field.
Torch-free, as the scheduler process is."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

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


def test_proposals_are_cut_where_the_grammar_refuses_and_masked_row_by_row(constrained,
                                                                          tokenizer) -> None:
    """Speculation (n-gram proposals): the proposals up to the first the grammar refuses, and a
    mask per row of a verified run (before each proposal and after the last), the matcher left
    where it was."""
    constrained.add(1, constrained.check(StructuredOutput(regex="ab+c")))
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in "abc")
    assert constrained.allowed_prefix(1, [a, b, b, c, a]) == [a, b, b, c]
    assert constrained.allowed_prefix(1, [c, a]) == []
    before = constrained.masks([1])[0][1]
    run = constrained.run_masks(1, [a, b])
    rows = [run[i * len(before):(i + 1) * len(before)] for i in range(3)]
    assert len(run) == 3 * len(before) and rows[0] == before
    assert a in allowed(rows[0]) and b not in allowed(rows[0])
    assert b in allowed(rows[1]) and c not in allowed(rows[1])
    assert {b, c} <= set(allowed(rows[2]))
    assert constrained.masks([1])[0][1] == before          # rolled back
    assert constrained.run_masks(2, [a]) is None           # not constrained


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


class RawTokenizer:
    """The served tokenizer's interface that GrammarCompiler uses, over a `tokenizers` JSON."""

    def __init__(self, spec: dict, shift: int = 0) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_str(json.dumps(spec))
        self.eos_token_id, self.shift = 2, shift

    def __call__(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        ids = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return SimpleNamespace(input_ids=[i + self.shift for i in ids])


def sentencepiece_decoded(tokenizer) -> dict:
    """SmolLM2's byte-level tokenizer as transformers 5.17 converted it from the GGUF:
    sentencepiece's decoders in front of ByteLevel, byte fallback on."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    spec["model"]["byte_fallback"] = True
    return spec


def test_a_byte_level_vocabulary_with_sentencepiece_decoders_still_takes_spaces(tokenizer) -> None:
    """Seen on a GPU machine with transformers 5.17: llguidance read 'Ġ' literally, so the
    token after a space was refused and constrained outputs ended early ("(817) "). Here every
    token of a valid phone number is allowed by the mask before it and taken, the last one
    completing the constraint."""
    raw = RawTokenizer(sentencepiece_decoded(tokenizer))
    requests = ConstrainedRequests()
    requests.configure(lambda: raw, VOCAB, [2])
    requests.add(1, requests.check(StructuredOutput(regex=r"\(\d{3}\) \d{3}-\d{4}")))
    ids = raw("(817) 555-0199").input_ids
    steps = []
    for token in ids:
        steps.append((token in allowed(requests.masks([1])[0][1]), requests.accept(1, token)))
    assert steps == [(True, False)] * (len(ids) - 1) + [(True, True)]


def test_a_tokenizer_llguidance_reads_differently_is_refused_saying_so(tokenizer) -> None:
    """Token ids that do not spell what the tokenizer means (here shifted by one): no silent
    wrong masks, an error for the request."""
    raw = RawTokenizer(json.loads(tokenizer.backend_tokenizer.to_str()), shift=1)
    requests = ConstrainedRequests()
    requests.configure(lambda: raw, VOCAB, [2])
    with pytest.raises(ValueError, match="reads this tokenizer's tokens differently"):
        requests.check(StructuredOutput(regex="[0-9]+"))
