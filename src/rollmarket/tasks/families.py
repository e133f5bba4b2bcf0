"""Task families over the world, each with a gold trajectory computed by the reference tools.

    calculator  arithmetic a model should not do in its head (2-3 operands, 2-3 digits; most as
                word problems, some with the operands in another order than the expression
                needs or a number spelled out): one calculator call, then the number.
    lookup      one web_search (a fact about a town, company or person) or one read_file (a value
                in config/*.toml or notes/*.txt), then the value.
    chain       2-3 dependent calls: search, search, calculator; search then search on its result;
                search then calculator (an age, years since a founding); read_file then calculator.
    plain       no tool: facts of the world a model memorises in training (region of a town,
                capital of a region) and trivial questions (one-digit sums, weekdays, the first
                letter or the length of a word).

Every task offers the same three tools, so choosing whether and which to call is part of it.
Splits are seeds: the same (family, n, seed) gives the same tasks; `generate_split` removes from
train every prompt that also occurs in held-out, except for `plain`, whose held-out tasks ask
facts a model can only know from training.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .answers import check_answer
from .task import Task
from .tools_ref import TOOL_SCHEMAS, calculator, run_tool
from .world import World, load_world, slug

FAMILIES = ("calculator", "lookup", "chain", "plain")
# Families whose held-out tasks test recall of facts trained on, so held-out prompts stay in train.
MEMORIZED = ("plain",)
SPLIT_SEEDS = {"train": 1, "heldout": 2}
SYSTEM = "You are a helpful assistant. Use a tool when you need one. Reply with the bare answer."
TOOLS = [TOOL_SCHEMAS["calculator"], TOOL_SCHEMAS["web_search"], TOOL_SCHEMAS["read_file"]]

Call = tuple[str, dict]
# A plan: (question, expected answer, verifier, tool calls in order).
Plan = tuple[str, str, str, list[Call]]

_OPS = ["+", "-", "*"]
AGE_YEAR = 2024
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_NOUNS = [("crate", "crates", "jars"), ("box", "boxes", "pens"), ("shelf", "shelves", "books"),
          ("tray", "trays", "cups"), ("bag", "bags", "apples")]


_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """0..999 in English words: 342 -> 'three hundred forty-two'."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_words(rest))


def _num(rng: random.Random) -> int:
    return rng.randint(10, 999) if rng.random() < 0.5 else rng.randint(10, 99)


def _calculator(rng: random.Random, world: World) -> Plan:
    kind = rng.random()
    name = rng.choice(world.people).name.split()[0]
    if kind < 0.4:
        operands = [_num(rng) for _ in range(rng.choice([2, 2, 3]))]
        expr = str(operands[0])
        for x in operands[1:]:
            expr += f" {rng.choice(_OPS)} {x}"
        question = rng.choice(["What is {e}?", "Compute {e}.", "Calculate {e}.", "What does {e} equal?"]).format(e=expr)
    elif kind < 0.5:
        unit, _, things = rng.choice(_NOUNS)
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        expr = f"{a} * {b}"
        question = f"Each {unit} holds {a} {things}. How many {things} are in {b} of them?"
    elif kind < 0.6:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        expr = f"{a} - {b}"
        question = f"{name} had {a} coins and spent {b}. How many coins are left?"
    elif kind < 0.7:
        # The operands come in the other order than the expression needs.
        a, b = rng.randint(10, 99), rng.randint(100, 999)
        expr = f"{b} - {a}"
        question = rng.choice(["What is {a} less than {b}?", "Subtract {a} from {b}."]).format(a=a, b=b)
    elif kind < 0.85:
        # One operand spelled out: the model has to write it in digits.
        a, b = rng.randint(20, 999), _num(rng)
        op, word = rng.choice([("+", "plus"), ("-", "minus"), ("*", "times")])
        expr = f"{a} {op} {b}"
        question = f"What is {number_words(a)} {word} {b}?"
    elif kind < 0.9:
        _, units, things = rng.choice(_NOUNS)
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 11)
        expr = f"{a} * {b} + {c}"
        question = f"{name} has {b} full {units} of {a} {things} each and {c} loose {things}. How many {things} in all?"
    else:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(100, 999)
        expr = f"{a} + {b} + {c}"
        question = f"What is the sum of {a}, {b} and {c}?"
    return question, calculator(expr), "numeric", [("calculator", {"expression": expr})]


def _lookup(rng: random.Random, world: World) -> Plan:
    kind = rng.randrange(4)
    if kind == 0:
        t = rng.choice(world.towns)
        question, query, expected, verifier = rng.choice([
            (f"What is the population of {t.name}?", f"{t.name} population", str(t.population), "numeric"),
            (f"When was {t.name} founded?", f"{t.name} founded", str(t.founded), "numeric"),
            (f"Who is the mayor of {t.name}?", f"{t.name} mayor", t.mayor, "exact"),
        ])
    elif kind == 1:
        c = rng.choice(world.companies)
        question, query, expected, verifier = rng.choice([
            (f"Who founded {c.name}?", f"{c.name} founder", c.founder, "exact"),
            (f"In which year was {c.name} founded?", f"{c.name} founded", str(c.founded), "numeric"),
            (f"How many employees does {c.name} have?", f"{c.name} employees", str(c.employees), "numeric"),
            (f"In which town is {c.name} based?", f"{c.name} town", c.town, "exact"),
        ])
    elif kind == 2:
        p = rng.choice(world.people)
        question, query, expected, verifier = rng.choice([
            (f"In which year was {p.name} born?", f"{p.name} born", str(p.born), "numeric"),
            (f"What is the occupation of {p.name}?", f"{p.name} occupation", p.occupation, "exact"),
            (f"Which town is {p.name} from?", f"{p.name} town", p.town, "exact"),
        ])
    else:
        if rng.random() < 0.5:
            s = rng.choice(world.services)
            path = f"config/{s.name}.toml"
            key, expected, verifier = rng.choice([("port", str(s.port), "numeric"),
                                                  ("workers", str(s.workers), "numeric"),
                                                  ("timeout", str(s.timeout), "numeric"),
                                                  ("owner", s.owner, "exact")])
            question = f"What is the {key} of the {s.name} service? Its config is {path}."
        else:
            c = rng.choice(world.companies)
            path = f"notes/{slug(c.name)}.txt"
            item, count = rng.choice(sorted(c.stock.items()))
            question, expected, verifier = f"How many {item} does {c.name} have in stock? See {path}.", str(count), "numeric"
        return question, expected, verifier, [("read_file", {"path": path})]
    return question, expected, verifier, [("web_search", {"query": query})]


def _chain(rng: random.Random, world: World) -> Plan:
    kind = rng.randrange(6)
    if kind == 0:
        t1, t2 = rng.sample(world.towns, 2)
        expr = f"{t1.population} + {t2.population}"
        return (f"What is the combined population of {t1.name} and {t2.name}?", calculator(expr), "numeric",
                [("web_search", {"query": f"{t1.name} population"}),
                 ("web_search", {"query": f"{t2.name} population"}), ("calculator", {"expression": expr})])
    if kind == 1:
        pairs = [(t, c) for t in world.towns for c in world.companies if c.founded > t.founded]
        t, c = rng.choice(pairs)
        expr = f"{c.founded} - {t.founded}"
        return (f"How many years after the founding of {t.name} was {c.name} founded?", calculator(expr), "numeric",
                [("web_search", {"query": f"{t.name} founded"}), ("web_search", {"query": f"{c.name} founded"}),
                 ("calculator", {"expression": expr})])
    if kind == 2:
        c = rng.choice(world.companies)
        t = world.town(c.town)
        return (f"What is the population of the town where {c.name} is based?", str(t.population), "numeric",
                [("web_search", {"query": f"{c.name} town"}), ("web_search", {"query": f"{t.name} population"})])
    if kind == 3:
        p = rng.choice(world.people)
        expr = f"{AGE_YEAR} - {p.born}"
        return (f"How old is {p.name} in {AGE_YEAR}?", calculator(expr), "numeric",
                [("web_search", {"query": f"{p.name} born"}), ("calculator", {"expression": expr})])
    if kind == 4:
        name, founded = rng.choice([(t.name, t.founded) for t in world.towns] +
                                   [(c.name, c.founded) for c in world.companies])
        expr = f"{AGE_YEAR} - {founded}"
        return (f"How many years before {AGE_YEAR} was {name} founded?", calculator(expr), "numeric",
                [("web_search", {"query": f"{name} founded"}), ("calculator", {"expression": expr})])
    c = rng.choice(world.companies)
    path = f"notes/{slug(c.name)}.txt"
    (i1, n1), (i2, n2) = rng.sample(sorted(c.stock.items()), 2)
    expr = f"{n1} + {n2}"
    return (f"How many {i1} and {i2} does {c.name} have in stock together? See {path}.", calculator(expr), "numeric",
            [("read_file", {"path": path}), ("calculator", {"expression": expr})])


def _plain(rng: random.Random, world: World) -> Plan:
    kind = rng.random()
    if kind < 0.3:
        t = rng.choice(world.towns)
        question = rng.choice(["Which region is {t} in?", "In which region does {t} lie?"]).format(t=t.name)
        return question, t.region, "exact", []
    if kind < 0.4:
        r = rng.choice(world.regions)
        question = rng.choice(["What is the capital of {r}?", "Name the capital of {r}."]).format(r=r.name)
        return question, r.capital, "exact", []
    if kind < 0.6:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return rng.choice(["What is {a} + {b}?", "Add {a} and {b}."]).format(a=a, b=b), str(a + b), "numeric", []
    if kind < 0.7:
        i = rng.randrange(7)
        return f"What day comes after {_DAYS[i]}?", _DAYS[(i + 1) % 7], "exact", []
    # Spelling questions: trivial for a person, hard for a model that sees tokens, not letters.
    word = rng.choice([t.name for t in world.towns] + [p.name.split()[1] for p in world.people])
    if kind < 0.85:
        return f"What is the first letter of the word {word}?", word[0], "exact", []
    return f"How many letters are in the word {word}?", str(len(word)), "numeric", []


BUILDERS: dict[str, Callable[[random.Random, World], Plan]] = {
    "calculator": _calculator, "lookup": _lookup, "chain": _chain, "plain": _plain,
}


def gold_trajectory(calls: list[Call], expected: str, verifier: str, *, world: World,
                    files: dict[str, str]) -> list[dict]:
    """Assistant tool calls (one per turn), the reference tools' results, then the bare answer."""
    gold: list[dict] = []
    last = None
    for i, (name, args) in enumerate(calls):
        call_id = f"call_{i}"
        gold.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": dict(args)}}]})
        last = run_tool(name, args, world=world, files=files)
        gold.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": last})
    if last is not None and expected not in last and not (calls[-1][0] == "calculator" and
                                                          check_answer(verifier, last, expected)):
        raise ValueError(f"gold tools do not produce the answer {expected!r}: {last!r}")
    gold.append({"role": "assistant", "content": expected})
    return gold


def _task_files(rng: random.Random, world: World, calls: list[Call], distractors: int = 3) -> dict[str, str]:
    """The task directory: the files its read_file calls need plus a few others (none if it reads none)."""
    paths = [args["path"] for name, args in calls if name == "read_file"]
    if not paths:
        return {}
    paths += rng.sample(sorted(set(world.files) - set(paths)), distractors)
    return {p: world.files[p] for p in sorted(paths)}


def make_task(family: str, seed: int, index: int, world: World | None = None) -> Task:
    """Task `index` of `family` under `seed` (independent of how many others are generated)."""
    world = world or load_world()
    rng = random.Random(f"{family}/{seed}/{index}")
    question, expected, verifier, calls = BUILDERS[family](rng, world)
    files = _task_files(rng, world, calls)
    return Task(
        id=f"{family}-{seed}-{index}", family=family,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tools=TOOLS, files=files, expected=expected, verifier=verifier,
        gold=gold_trajectory(calls, expected, verifier, world=world, files=files),
    )


def generate(family: str, n: int, seed: int, world: World | None = None) -> list[Task]:
    """`n` tasks of `family` under `seed`."""
    if family not in BUILDERS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return [make_task(family, seed, i, world) for i in range(n)]


def generate_split(split: str, n_per_family: int | dict[str, int], world: World | None = None,
                   families: tuple[str, ...] = FAMILIES, exclude_prompts: set[str] | None = None) -> list[Task]:
    """Tasks of every family for `split` ('train' or 'heldout'), minus those whose prompt is in
    `exclude_prompts` (except in MEMORIZED families, where seeing the question in training is the point)."""
    seed = SPLIT_SEEDS[split]
    world = world or load_world()
    exclude = exclude_prompts or set()
    out: list[Task] = []
    for family in families:
        n = n_per_family[family] if isinstance(n_per_family, dict) else n_per_family
        tasks = generate(family, n, seed, world)
        out += tasks if family in MEMORIZED else [t for t in tasks if t.prompt not in exclude]
    return out
