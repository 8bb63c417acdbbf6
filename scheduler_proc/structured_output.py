"""Structured outputs in the scheduler: a request's StructuredOutput becomes an llguidance
matcher, which says after every token what may come next, as a bitmask over the vocabulary that
the workers apply to the logits before sampling.

Grammars are compiled when a request arrives (while the workers compute the step in flight),
once per distinct constraint: a compiled matcher is kept as a template and each request gets a
copy, advanced by the tokens it samples. llguidance needs no torch, so this process stays
torch-free; the tokenizer llguidance walks is the served one (its Rust tokenizer, serialised).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict

import llguidance
from spmd_runtime.protocol.sampling import StructuredOutput

log = logging.getLogger("spmd.scheduler")

# Compiled constraints kept (LRU): a server sees a few schemas many times, not many once.
CACHE_SIZE = 256
# JSON as compact as the schema allows: no free whitespace for a sampled model to wander in.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; each `matcher` call gives a
    request a fresh matcher of its constraint."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = llguidance_tokenizer(hf_tokenizer, vocab_size,
                                              list(eos_token_ids) or hf_tokenizer.eos_token_id)
        self._templates: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the start of `spec`'s language. ValueError naming the field when the
        constraint does not compile (a bad schema, regex or grammar)."""
        key = _cache_key(spec)
        template = self._templates.get(key)
        if template is None:
            template = self._compile(spec)
            self._templates[key] = template
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        field = f"structured_output.{spec.kind}"
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{field} is not valid: {error}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field} is not valid: {matcher.get_error()}")
        return matcher


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar of a constraint."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)   # Lark, or GBNF converted to it


# Spaces, brackets, digits, quotes and a newline: what constrained outputs are made of.
TOKEN_PROBE = 'The capital of France is (817) 555-0199; {"a": [1, 2.5], "b": "hi there"}\n'


def llguidance_tokenizer(hf_tokenizer, vocab_size: int, eos) -> llguidance.LLTokenizer:
    """llguidance's view of the served tokenizer, checked to read tokens as the tokenizer does
    (ValueError otherwise: a wrong view would mask the wrong tokens without a word).

    A byte-level BPE vocabulary (GPT-2's alphabet, 'Ġ' standing for a space) is given a plain
    ByteLevel decoder. Some transformers versions (5.17) convert a GGUF's byte-level tokenizer
    with sentencepiece's decoders in front (ByteFallback, Fuse, Replace) and byte fallback on;
    llguidance then took 'Ġ' literally, so no mask allowed a space."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    if _is_byte_level(spec.get("pre_tokenizer")):
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                           "use_regex": True}
        spec["model"]["byte_fallback"] = False
    tokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos)
    ids = hf_tokenizer(TOKEN_PROBE, add_special_tokens=False).input_ids
    read = tokenizer.decode_bytes(ids)
    if read != TOKEN_PROBE.encode():
        raise ValueError(f"llguidance reads this tokenizer's tokens differently from the tokenizer "
                         f"itself ({read[:60]!r} for {TOKEN_PROBE[:60]!r}): structured outputs "
                         "are not available with it")
    return tokenizer


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"


def _cache_key(spec: StructuredOutput) -> tuple:
    value = getattr(spec, spec.kind)
    if isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    return spec.kind, value


class ConstrainedRequests:
    """The matchers of the requests that have one, by request id. The compiler is made on the
    first constrained request (building llguidance's view of the tokenizer takes ~0.2 s)."""

    def __init__(self) -> None:
        self._compiler_args: tuple | None = None
        self._compiler: GrammarCompiler | None = None
        self.matchers: dict[int, llguidance.LLMatcher] = {}

    def configure(self, tokenizer_source, vocab_size: int, eos_token_ids: list[int]) -> None:
        """tokenizer_source: () -> the served HF tokenizer, or ValueError saying why none."""
        self._compiler_args = (tokenizer_source, vocab_size, eos_token_ids)

    def check(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher for a new request's constraint, or ValueError saying what is wrong."""
        if self._compiler is None:
            if self._compiler_args is None:
                raise ValueError("structured outputs are not available in this engine")
            source, vocab_size, eos = self._compiler_args
            try:
                tokenizer = source()
            except ValueError as error:
                raise ValueError(f"structured outputs need the model's tokenizer: {error}") from None
            self._compiler = GrammarCompiler(tokenizer, vocab_size, eos)
        return self._compiler.matcher(spec)

    def add(self, request_id: int, matcher: llguidance.LLMatcher) -> None:
        self.matchers[request_id] = matcher

    def accept(self, request_id: int, token: int) -> bool:
        """Advance a request's matcher by the token it sampled; True when its constraint is
        complete (nothing but the end may follow). Unconstrained requests: False."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token):
            log.warning("request %d sampled token %d its constraint refuses: %s", request_id, token,
                        matcher.get_error())
            return True
        return matcher.is_stopped()

    def masks(self, request_ids) -> list[tuple[int, bytes]]:
        """(request id, bitmask) for the constrained ones of `request_ids`: bit t of 32-bit
        word t // 32 (little-endian) set where token t may come next."""
        return [(rid, self.matchers[rid].compute_bitmask()) for rid in request_ids
                if rid in self.matchers]

    def allowed_prefix(self, request_id: int, proposals: list[int]) -> list[int]:
        """The proposals up to the first one the request's grammar refuses after the others."""
        matcher = self.matchers.get(request_id)
        return proposals if matcher is None else proposals[:matcher.validate_tokens(proposals)]

    def run_masks(self, request_id: int, proposals: list[int]) -> bytes | None:
        """The bitmasks of a verified run's rows, concatenated: before each proposal and after
        the last (the grammar having taken the ones before); the matcher is left as it was.
        None for an unconstrained request."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return None
        masks = [matcher.compute_bitmask()]
        for token in proposals:
            if not matcher.consume_token(token):
                raise ValueError(f"request {request_id}: proposal {token} refused by its "
                                 f"grammar: {matcher.get_error()}")
            masks.append(matcher.compute_bitmask())
        matcher.rollback(len(proposals))
        return b"".join(masks)

    def forget(self, request_id: int) -> None:
        self.matchers.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self.matchers)
