"""Speculative decoding on an edit workload (issue 35): one request at a time asks SmolLM2 to fix
the spelling of a paragraph, so its answer repeats the paragraph, and n-gram prompt lookup finds
most of what comes next in the prompt.

    python bench/speculative_edit.py --rounds 3
    python bench/speculative_edit.py --rounds 3 --ours off='{}' \
        --ours k8='{"speculative": "ngram", "num_speculative_tokens": 8}'

Each round starts every engine afresh (start-up not timed), alternating their order (the first
engine first in odd rounds). In each, per paragraph (five, each with three misspellings, so that
no prefix cache helps across calls): TTFT is a 1-token generation's time, and the whole answer
(greedy, ending at EOS or 256 tokens) gives ITL = (t - TTFT) / (tokens - 1); an engine's round
figure is the median over the paragraphs. The summary prints each engine's median ITL and TTFT,
and the median over rounds of the per-round ratio ITL(first engine) / ITL(other): above 1, the
other is faster. The engines' outputs are compared token for token (greedy: they must agree).

Defaults: off = {"speculative": "off"}, ngram = {"speculative": "ngram"}; every engine runs
runtime.LLM("smollm2", dtype="float32", device="cpu", **options), so --quantization is auto
(the embedded file's Q4_1 blocks) unless an option says otherwise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

PARAGRAPHS = [
    "Solar panels convert sunlight into electricity using photovoltaic cells made of silicon. When "
    "light strikes a cell, it knocks electrons loose, and the electric field inside the cell pushes "
    "them into a current. Panels are usually mounted on roofs facing south, tilted at an angle close "
    "to the local latitude. An inverter turns the direct current into the alternating current used "
    "by household appliances, and batteries can store the surplus for use at night.",
    "The city library opened its new reading room on Monday morning. The room has tall windows, long "
    "oak tables and shelves for more than twenty thousand books. Visitors can borrow up to ten books "
    "at a time for three weeks, and the staff hold free workshops on research skills every Thursday "
    "afternoon. The project took two years and was paid for by local donations.",
    "Bread dough needs flour, water, salt and yeast. Mix them until the dough is smooth, then leave it "
    "in a warm place for about an hour, until it has doubled in size. Knock it back, shape it into a "
    "loaf and let it rise again for thirty minutes. Bake it in a hot oven for forty minutes, until the "
    "crust is golden and the loaf sounds hollow when tapped underneath.",
    "Honey bees live in colonies of up to sixty thousand workers and one queen. The workers collect "
    "nectar and pollen from flowers, build wax combs and keep the hive at a steady temperature. A "
    "forager that finds a good patch of flowers returns and performs a dance that tells the others "
    "its direction and distance. In winter the colony clusters together to stay warm.",
    "The train leaves the central station at half past eight and reaches the coast shortly before "
    "noon. It stops at four towns on the way, crossing the river twice and passing through a long "
    "tunnel under the hills. Tickets are cheaper if you buy them a week in advance, and children "
    "under twelve travel free with an adult. The last train back departs at nine in the evening.",
]
MISSPELLINGS = {"the": "teh", "and": "adn", "which": "wich", "their": "thier", "until": "untill",
                "of": "fo", "into": "inot", "with": "wiht"}
MAX_TOKENS = 256


def misspelled(paragraph: str) -> str:
    """The paragraph with its first three misspellable words misspelled."""
    words, done = paragraph.split(" "), 0
    for i, word in enumerate(words):
        if done < 3 and word in MISSPELLINGS:
            words[i], done = MISSPELLINGS[word], done + 1
    return " ".join(words)


def conversation(paragraph: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Fix the spelling mistakes in this text and return the "
                                        f"corrected text:\n\n{misspelled(paragraph)}"}]


def run_engine(options: dict) -> dict:
    """One fresh engine over every paragraph: per paragraph TTFT, ITL and the output tokens."""
    from spmd_runtime.runtime import LLM, SamplingParams

    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    answer = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM("smollm2", dtype="float32", device="cpu", **options) as llm:
        llm.chat([conversation("Warm up the engine.")], first_token)
        ttfts, itls, outputs = [], [], []
        for paragraph in PARAGRAPHS:
            started = time.perf_counter()
            llm.chat([conversation(paragraph)], first_token)
            ttft = time.perf_counter() - started
            # The same prompt again would hit the prefix cache: TTFT is subtracted as measured.
            started = time.perf_counter()
            (output,) = llm.chat([conversation(paragraph)], answer)
            elapsed = time.perf_counter() - started
            ttfts.append(ttft)
            itls.append((elapsed - ttft) / max(1, len(output.token_ids) - 1))
            outputs.append(list(output.token_ids))
        stats = llm.client.stats()
    return {"ttft_s": statistics.median(ttfts), "itl_s": statistics.median(itls),
            "tokens": [len(o) for o in outputs], "outputs": outputs,
            "acceptance": stats.spec_decode_acceptance_rate,
            "tokens_per_draft": stats.spec_decode_tokens_per_draft}


def parse_engine(text: str) -> tuple[str, dict]:
    name, _, options = text.partition("=")
    return name, json.loads(options or "{}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ours", action="append", type=parse_engine, metavar="NAME=JSON",
                        help="an engine's options (two or more; default off and ngram)")
    parser.add_argument("--json", help="write every round's figures to this file")
    args = parser.parse_args()
    engines = args.ours or [("off", {"speculative": "off"}), ("ngram", {"speculative": "ngram"})]
    rounds = []
    for number in range(args.rounds):
        order = engines if number % 2 == 0 else engines[::-1]
        results = {name: run_engine(options) for name, options in order}
        rounds.append(results)
        print(f"round {number + 1}: " + "; ".join(
            f"{name} ITL {r['itl_s'] * 1e3:.1f} ms, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
            f"acceptance {r['acceptance']:.0%}, {r['tokens_per_draft']:.2f} tokens/draft"
            for name, r in results.items()), flush=True)
    base = engines[0][0]
    for name, _ in engines:
        itl = statistics.median(r[name]["itl_s"] for r in rounds)
        ttft = statistics.median(r[name]["ttft_s"] for r in rounds)
        line = f"{name}: ITL {itl * 1e3:.1f} ms, TTFT {ttft * 1e3:.0f} ms (medians)"
        if name != base:
            ratio = statistics.median(r[base]["itl_s"] / r[name]["itl_s"] for r in rounds)
            same = all(r[name]["outputs"] == r[base]["outputs"] for r in rounds)
            line += (f"; ITL {base}/{name} = {ratio:.2f}x (median of per-round ratios); outputs "
                     f"{'identical' if same else 'DIFFER'} to {base}'s")
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{n: {k: v for k, v in r.items() if k != "outputs"} for n, r in rnd.items()}
                       for rnd in rounds], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
