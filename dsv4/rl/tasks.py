"""RL tasks: prompts and rule-based rewards for GRPO, plus pluggable reward functions.

A task hands out prompts as token ids and scores a response's token ids. Prompts are a pure function of
(seed, step, n), so a resumed run sees the prompts it would have seen; n is the number of distinct prompts,
and the trainer sends each one group_size times.

* `echo` and `copy`: synthetic digit tasks over byte tokens (digit d is id 48 + d) for a randomly
  initialised model. The response is sampled from the digit ids only (`allowed_token_ids`), which the
  reference found necessary: over the full vocabulary these tasks collapse to a few tokens and the groups
  die (docs: rl-reference.md §4). echo learns in 10-20 steps on CPU; copy is the harder variant.
* `math`: a final-answer verifier for real weights, over a small self-made problem set
  (data/rl_math_smoke.jsonl, written by `write_math_smoke`; the test keeps file and generator equal).

Where this departs from miles' `--rm-type math` (`rm_hub/math_utils.py`), and why: the verifier here
compares numbers as exact fractions after light normalisation and does no symbolic (sympy) equivalence;
that is enough for integer and simple-fraction answers and keeps the reward deterministic and cheap.
Only the text after the last `</think>` is searched, so a number in the reasoning does not count as the
answer.

Custom rewards: `load_reward("package.module:function")` gives a callable with the signature of
`Task.reward`, `(sample, response_ids) -> float`; `score` runs one over a batch and names the sample that
failed.
"""
from __future__ import annotations

import difflib
import importlib
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

DIGIT0 = ord("0")  # byte-level ids: "0".."9" are 48..57
MATH_SMOKE_PATH = Path(__file__).resolve().parents[2] / "data" / "rl_math_smoke.jsonl"
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass
class Sample:
    prompt_ids: list[int]
    answer: str | list[int]  # text for verifiers, token ids for the synthetic tasks
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    name: str

    @property
    def allowed_token_ids(self) -> list[int] | None: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def stop_token_ids(self) -> list[int] | None: ...
    def prompts(self, step: int, n: int, seed: int) -> list[Sample]: ...
    def reward(self, sample: Sample, response_ids: Sequence[int]) -> float: ...


def sampling_params(task: Task, temperature: float = 1.0, **extra) -> dict:
    """The task's SGLang sampling_params (dsv4.rl.api.SamplingParams keys); the trainer must score the
    response with the same `allowed_token_ids` and temperature (dsv4.rl.grpo.restricted_logprobs)."""
    out: dict[str, Any] = {"max_new_tokens": task.max_new_tokens, "temperature": temperature}
    if task.allowed_token_ids is not None:
        out["allowed_token_ids"] = list(task.allowed_token_ids)
    if task.stop_token_ids:
        out["stop_token_ids"] = list(task.stop_token_ids)
    out.update(extra)
    return out


def _rng(task: str, seed: int, step: int) -> random.Random:
    # a string seed is hashed with SHA-512 by random.Random: stable across processes and Python versions,
    # unlike hash(), which PYTHONHASHSEED salts
    return random.Random(f"dsv4.rl.tasks/{task}/{int(seed)}/{int(step)}")


def _check_step_n(step: int, n: int) -> None:
    if step < 0 or n < 0:
        raise ValueError(f"step and n must be >= 0, got step={step}, n={n}")


# ======================================================================================= digit tasks
@dataclass
class _DigitTask:
    prompt_len: int = 4  # digits in a prompt
    num_digits: int = 10  # the alphabet: digits 0..num_digits-1 (fewer digits, more reward at init)
    prefix_ids: tuple[int, ...] = ()  # e.g. (bos_id,) before the digits

    name = "digits"

    def __post_init__(self):
        if not 1 <= self.num_digits <= 10:
            raise ValueError(f"{self.name}: num_digits must be in 1..10, got {self.num_digits}")
        if self.prompt_len < 1:
            raise ValueError(f"{self.name}: prompt_len must be >= 1, got {self.prompt_len}")
        self.prefix_ids = tuple(int(i) for i in self.prefix_ids)

    @property
    def allowed_token_ids(self) -> list[int]:
        return [DIGIT0 + d for d in range(self.num_digits)]

    @property
    def stop_token_ids(self) -> None:
        return None  # the digit restriction leaves no stop token to sample; length is max_new_tokens

    def _answer(self, digits: list[int]) -> list[int]:
        raise NotImplementedError

    def prompts(self, step: int, n: int, seed: int) -> list[Sample]:
        _check_step_n(step, n)
        rng = _rng(self.name, seed, step)
        out = []
        for i in range(n):
            ids = [DIGIT0 + rng.randrange(self.num_digits) for _ in range(self.prompt_len)]
            out.append(Sample(list(self.prefix_ids) + ids, self._answer(ids),
                              {"task": self.name, "step": step, "index": i, "text": bytes(ids).decode()}))
        return out


@dataclass
class EchoTask(_DigitTask):
    """Answer with the last digit of the prompt; reward 1.0 when the first response token is it."""

    name = "echo"

    @property
    def max_new_tokens(self) -> int:
        return 1

    def _answer(self, digits: list[int]) -> list[int]:
        return digits[-1:]

    def reward(self, sample: Sample, response_ids: Sequence[int]) -> float:
        return float(len(response_ids) > 0 and int(response_ids[0]) == sample.answer[0])


@dataclass
class CopyTask(_DigitTask):
    """Copy the first k prompt digits. Reward: the fraction of the k positions right, so that a random
    policy already earns some (1/num_digits on average); exact=True pays only a full copy."""

    prompt_len: int = 8
    k: int = 4
    exact: bool = False

    name = "copy"

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.k <= self.prompt_len:
            raise ValueError(f"copy: k must be in 1..prompt_len={self.prompt_len}, got {self.k}")

    @property
    def max_new_tokens(self) -> int:
        return self.k

    def _answer(self, digits: list[int]) -> list[int]:
        return digits[:self.k]

    def reward(self, sample: Sample, response_ids: Sequence[int]) -> float:
        hits = sum(int(a == b) for a, b in zip(sample.answer, response_ids))
        if self.exact:
            return float(hits == len(sample.answer))
        return hits / len(sample.answer)


# ====================================================================================== math verifier
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# a sign only where it cannot be a binary minus ("5-3" is not -3)
_NUMBER = re.compile(rf"(?:(?<![\w)\]}}])[-+])?{_NUM}(?:/\d+(?:\.\d+)?)?")
_ANSWER_IS = re.compile(r"answer\s*(?:is\b|:|=)\s*:?\s*", re.IGNORECASE)
_LATEX_SPACES = re.compile(r"\\[!,;: ]|\\q?quad|\\left|\\right")
_LATEX_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}$")


def _after_think(text: str) -> str:
    i = text.rfind("</think>")
    return text[i + len("</think>"):] if i >= 0 else text


def _boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} / \\fbox{...} (braces balanced), or of `\\boxed 42`."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)(?![a-zA-Z])\s*", text))):
        j = m.end()
        if j < len(text) and text[j] == "{":
            depth = 0
            for k in range(j, len(text)):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    return text[j + 1:k]
            continue  # cut off before its closing brace: an earlier box may be whole
        bare = re.match(r"[^\s$]+", text[j:])
        if bare:
            return bare.group(0)
    return None


def _clean(s: str) -> str:
    s = s.strip().replace("\u2212", "-")
    s = _LATEX_TEXT.sub(r"\1", s)
    s = _LATEX_SPACES.sub("", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
    for a, b in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(a) and s.endswith(b):
            s = s[len(a):-len(b)]
    s = s.strip().rstrip(".").strip()
    return s


def _leading_number(s: str) -> str:
    """The number a free-text answer starts with ("42 apples." -> "42"), else the text itself."""
    if _FRAC.match(s):
        return s
    m = re.match(rf"[-+]?{_NUM}(?:\s*/\s*\d+(?:\.\d+)?)?%?", s)
    return m.group(0) if m else s


def extract_final_answer(text: str) -> str | None:
    """The final answer a response states, as written (cleaned of LaTeX spacing and $), or None.

    Looked for, after the last `</think>`, in this order: the last complete, non-empty \\boxed{...} (nested
    braces; `x = 5` inside keeps what follows the last `=`), the last `#### ...` line, the last "answer is ..." /
    "answer: ...", then the last number in the text.
    """
    text = _after_think(text)
    box = _boxed(text)
    if box is not None and box.strip():  # an empty box is the instruction echoed, not an answer
        ans = _clean(box)
        return _clean(ans.rsplit("=", 1)[-1]) if "=" in ans else ans
    hashes = re.findall(r"####\s*([^\n]*)", text)
    if hashes and hashes[-1].strip():
        return _leading_number(_clean(hashes[-1]))
    stated = list(_ANSWER_IS.finditer(text))
    if stated:
        rest = text[stated[-1].end():].split("\n", 1)[0]
        # the sentence ends at a period that is not a decimal point
        rest = re.split(r"\.(?!\d)", rest, maxsplit=1)[0]
        if rest.strip():
            return _leading_number(_clean(rest))
    nums = _NUMBER.findall(text.replace("\u2212", "-"))
    return nums[-1] if nums else None


def _to_number(s: str) -> Fraction | None:
    s = s.replace(" ", "").rstrip("%").lstrip("+")
    m = _FRAC.match(s)
    if m:
        num, den = _to_number(m.group(2)), _to_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        return -(num / den) if m.group(1) == "-" else num / den
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    m = re.fullmatch(r"(-?(?:\d+(?:\.\d*)?|\.\d+))(?:/(\d+(?:\.\d+)?))?", s)
    if not m:
        return None
    value = Fraction(m.group(1))
    if m.group(2) is not None:
        den = Fraction(m.group(2))
        if den == 0:
            return None
        value /= den
    return value


def normalize_answer(s: str) -> str:
    """Canonical form for comparison: numbers as exact fractions ("1,234.0" -> "1234", "0.5" and
    "\\frac{1}{2}" -> "1/2", "+7" -> "7"), anything else lower-cased without whitespace."""
    s = _clean(str(s))
    value = _to_number(s)
    if value is not None:
        return str(value)
    return re.sub(r"\s+", "", s).lower()


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    return normalize_answer(predicted) == normalize_answer(reference)


def math_reward(response_text: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` (as values for numbers), else 0.0."""
    return float(answers_match(extract_final_answer(response_text), answer))


# ====================================================================================== math problems
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
_THINGS = ["apples", "marbles", "stickers", "pencils", "stamps", "shells", "cards", "coins"]


def make_math_problems(n: int = 40, seed: int = 0) -> list[dict]:
    """n self-made arithmetic and word problems [{"id", "question", "answer"}], a pure function of (n, seed).
    Answers are integers or reduced fractions a/b, written plainly."""
    rng = random.Random(f"dsv4.rl.tasks/math-smoke/{seed}")
    out = []
    for i in range(n):
        kind = i % 8
        who, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        if kind == 0:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            q, ans = f"What is {a} + {b}?", a + b
        elif kind == 1:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            q, ans = f"What is {a} - {b}?", a - b
        elif kind == 2:
            a, b = rng.randint(2, 19), rng.randint(2, 12)
            q, ans = f"What is {a} times {b}?", a * b
        elif kind == 3:
            b, c = rng.randint(2, 12), rng.randint(2, 15)
            q, ans = f"What is {b * c} divided by {b}?", c
        elif kind == 4:
            a = rng.randint(12, 60)
            b = rng.randint(1, a - 1)
            q, ans = f"{who} has {a} {thing} and gives {b} of them away. How many {thing} does {who} have left?", a - b
        elif kind == 5:
            a, b = rng.randint(3, 12), rng.randint(2, 9)
            q, ans = f"A box holds {a} {thing}. How many {thing} are in {b} boxes?", a * b
        elif kind == 6:
            x, y = rng.sample([2, 3, 4, 5, 6, 8], 2)
            q, ans = f"What is 1/{x} + 1/{y}? Give the answer as a fraction.", Fraction(1, x) + Fraction(1, y)
        else:
            pct, base = rng.choice([10, 20, 25, 50, 75]), 20 * rng.randint(1, 25)  # whole-number answers
            q, ans = f"What is {pct}% of {base}?", Fraction(pct * base, 100)
        out.append({"id": f"math-smoke-{i:03d}", "question": q, "answer": str(ans)})
    return out


def math_smoke_text(n: int = 40, seed: int = 0) -> str:
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in make_math_problems(n, seed))


def write_math_smoke(path: str | Path = MATH_SMOKE_PATH) -> Path:
    """(Re)write data/rl_math_smoke.jsonl from `make_math_problems()`."""
    path = Path(path)
    path.write_text(math_smoke_text())
    return path


def load_math_problems(path: str | Path = MATH_SMOKE_PATH) -> list[dict]:
    """A jsonl of {"question", "answer"[, "id"]} rows; errors name the line."""
    path = Path(path)
    if not path.is_file():
        hint = " (regenerate it: python -m dsv4.rl.tasks)" if path == MATH_SMOKE_PATH else ""
        raise FileNotFoundError(f"{path}: no such problem file{hint}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
            raise ValueError(f"{path}:{lineno}: expected an object with a string 'question' and an 'answer'")
        rows.append({"id": str(row.get("id", f"{path.stem}-{lineno}")), "question": row["question"],
                     "answer": str(row["answer"])})
    if not rows:
        raise ValueError(f"{path}: no problems")
    return rows


@dataclass
class MathTask:
    """Final-answer math with a rule-based verifier. Prompts are rendered in the DeepSeek-V4 chat format
    (dsv4.encoding) unless chat=False, and tokenized with `tokenizer` (an object with encode/decode, or a
    checkpoint directory; default: the built-in byte-level tokenizer). Each epoch visits every problem
    once, in an order fixed by (seed, epoch)."""

    path: str | Path = MATH_SMOKE_PATH
    tokenizer: Any = None
    max_new_tokens: int = 256
    thinking_mode: str = "chat"
    chat: bool = True
    instruction: str = MATH_INSTRUCTION

    name = "math"

    def __post_init__(self):
        from dsv4.tokenizer import load_tokenizer

        if self.tokenizer is None or isinstance(self.tokenizer, (str, Path)):
            self.tokenizer = load_tokenizer(self.tokenizer)
        self.problems = load_math_problems(self.path)

    @property
    def allowed_token_ids(self) -> None:
        return None

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_id]

    def prompt_text(self, question: str) -> str:
        content = f"{question}\n{self.instruction}" if self.instruction else question
        if not self.chat:
            return content
        from dsv4.encoding import encode_messages

        return encode_messages([{"role": "user", "content": content}], self.thinking_mode)

    def prompts(self, step: int, n: int, seed: int) -> list[Sample]:
        _check_step_n(step, n)
        size, out, orders = len(self.problems), [], {}
        for j in range(step * n, step * n + n):
            epoch = j // size
            if epoch not in orders:
                orders[epoch] = list(range(size))
                _rng(self.name, seed, epoch).shuffle(orders[epoch])
            p = self.problems[orders[epoch][j % size]]
            text = self.prompt_text(p["question"])
            out.append(Sample(self.tokenizer.encode(text), p["answer"],
                              {"task": self.name, "step": step, "index": j - step * n, "id": p["id"],
                               "question": p["question"], "text": text}))
        return out

    def reward(self, sample: Sample, response_ids: Sequence[int]) -> float:
        return math_reward(self.tokenizer.decode(list(response_ids), skip_special=True), str(sample.answer))


# ===================================================================================== pluggable rewards
class RewardSpecError(ValueError):
    """A reward spec that does not name an importable callable."""


class RewardError(RuntimeError):
    """A reward function failed (or returned a non-number) on one sample."""

    def __init__(self, message: str, index: int, prompt: str, original: BaseException | None = None):
        super().__init__(message)
        self.index, self.prompt, self.original = index, prompt, original


def load_reward(spec: str) -> Callable[[Sample, Sequence[int]], float]:
    """"package.module:function" (or "package.module.function") -> that callable, which is called as
    fn(sample, response_ids) -> float. Errors say what is missing, for which spec, and how to fix it."""
    how = "write it as 'package.module:function', with the module importable (installed or on PYTHONPATH)"
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec {spec!r} is empty; {how}")
    spec = spec.strip()
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
    else:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr or any(not part.isidentifier() for part in mod_name.split(".") + attr.split(".")):
        raise RewardSpecError(f"reward spec {spec!r} is not a module and a function name; {how}")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise RewardSpecError(f"reward spec {spec!r}: no module named {e.name!r}. Check the spelling and that "
                                  f"the package is installed or on PYTHONPATH; {how}") from e
        raise RewardSpecError(f"reward spec {spec!r}: module {mod_name!r} exists but importing it failed because "
                              f"it needs {e.name!r}, which is not installed; install it") from e
    except Exception as e:
        raise RewardSpecError(f"reward spec {spec!r}: importing module {mod_name!r} raised "
                              f"{type(e).__name__}: {e}") from e
    obj: Any = module
    for depth, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = mod_name if depth == 0 else f"{mod_name}:{'.'.join(attr.split('.')[:depth])}"
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise RewardSpecError(f"reward spec {spec!r}: {where} has no attribute {part!r}.{hint} "
                                  f"Callables there: {', '.join(names[:20]) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward spec {spec!r} names a {type(obj).__name__}, not a function; point it at "
                              "a callable taking (sample, response_ids) and returning a float")
    return obj


def _describe_prompt(sample: Any, limit: int = 80) -> str:
    meta = getattr(sample, "meta", None) or {}
    text = meta.get("question") or meta.get("text")
    if text is None:
        text = repr(list(getattr(sample, "prompt_ids", []) or []))
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def score(reward_fn: Callable, samples: Sequence[Sample], responses: Sequence[Sequence[int]]) -> list[float]:
    """reward_fn(sample, response_ids) for each pair -> rewards; a failure becomes a RewardError that names
    the sample index and its prompt, with the original exception as the cause."""
    if len(samples) != len(responses):
        raise ValueError(f"{len(samples)} samples but {len(responses)} responses")
    name = getattr(reward_fn, "__qualname__", None) or repr(reward_fn)
    out = []
    for i, (s, resp) in enumerate(zip(samples, responses)):
        prompt = _describe_prompt(s)
        try:
            r = reward_fn(s, resp)
        except Exception as e:
            raise RewardError(f"reward {name} failed on sample {i} (prompt {prompt!r}): "
                              f"{type(e).__name__}: {e}", i, prompt, e) from e
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RewardError(f"reward {name} returned {r!r} ({type(r).__name__}) on sample {i} "
                              f"(prompt {prompt!r}); it must return a finite float", i, prompt)
        out.append(float(r))
    return out


# ============================================================================================= registry
TASKS: dict[str, type] = {"echo": EchoTask, "copy": CopyTask, "math": MathTask}


def make_task(name: str, **kw) -> Task:
    """TASKS[name](**kw), with errors that name the known tasks and the task's parameters."""
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), TASKS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown RL task {name!r}.{hint} Known: {', '.join(TASKS)}")
    cls = TASKS[name]
    params = [f.name for f in fields(cls)]
    unknown = [k for k in kw if k not in params]
    if unknown:
        raise ValueError(f"task {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                         f"its parameters: {', '.join(params)}")
    return cls(**kw)


if __name__ == "__main__":
    print(write_math_smoke())
