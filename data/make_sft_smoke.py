"""Regenerate data/sft_smoke.jsonl: 200 short, self-made chat conversations for smoke runs.

Deterministic (fixed seed, no downloads). The tasks are regular enough that a tiny model's
loss drops within a few steps: small-number arithmetic, string reversal, upper-casing,
opposites and a few fixed facts; some rows carry a system prompt, some have two turns.

    python data/make_sft_smoke.py            # rewrites data/sft_smoke.jsonl next to this file
"""
import json
import random
from pathlib import Path

N_ROWS = 200
SEED = 0
WORDS = ["cat", "dog", "sun", "tree", "book", "lamp", "river", "stone", "cloud", "apple", "green", "train"]
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "day": "night", "open": "closed",
             "left": "right", "old": "new", "wet": "dry", "full": "empty"}
FACTS = [
    ("How many days are in a week?", "There are 7 days in a week."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("What color is a clear daytime sky?", "A clear daytime sky is blue."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
    ("What do bees make?", "Bees make honey."),
    ("How many sides does a triangle have?", "A triangle has 3 sides."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("How many months are in a year?", "There are 12 months in a year."),
]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly."]


def qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        op = rng.choice("+-")
        return f"What is {a} {op} {b}?", f"{a} {op} {b} = {a + b if op == '+' else a - b}."
    if kind == 1:
        w = rng.choice(WORDS)
        return f"Reverse the word: {w}", w[::-1]
    if kind == 2:
        w = rng.choice(WORDS)
        return f"Write in capitals: {w}", w.upper()
    if kind == 3:
        w, o = rng.choice(sorted(OPPOSITES.items()))
        return f"What is the opposite of {w}?", f"The opposite of {w} is {o}."
    return rng.choice(FACTS)


def row(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(2 if rng.random() < 0.25 else 1):
        q, a = qa(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def main() -> None:
    rng = random.Random(SEED)
    out = Path(__file__).with_name("sft_smoke.jsonl")
    with out.open("w", encoding="utf-8") as f:
        for _ in range(N_ROWS):
            f.write(json.dumps(row(rng), ensure_ascii=False) + "\n")
    print(f"wrote {N_ROWS} conversations to {out}")


if __name__ == "__main__":
    main()
