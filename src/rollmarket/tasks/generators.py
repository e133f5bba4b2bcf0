"""Task generators beyond the tiny models' training families, for the shipped suites.

    chain4   four calls: three searches then a calculator (populations of three towns, employees
             of three companies), a dependent search among them (the town a company is based in),
             or three config files read then summed.
    chain5   five calls: four searches then a calculator, dependent hops (the towns where two
             people live, or where two companies are based), or three searches and a read_file.
    python   a question best answered by running code (Fibonacci numbers, counting primes, digit
             sums, divisors, Collatz steps, a harmonic sum as a fraction, sums over a CSV file),
             with the Python that answers it; the expected answer is computed here independently.

`families.py` stays as the tiny models were trained on it; these add families the same way: a
task is a pure function of (family, seed, index), and every gold call of a chain is run through
the reference tools, each later call using only what the question and the earlier results say
(`check_grounded`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from fractions import Fraction
from math import isqrt
from typing import Any

from .families import SYSTEM, TOOLS, Call, Plan, _task_files, gold_trajectory
from .families import make_task as make_family_task
from .task import Task
from .tools_ref import calculator, run_tool
from .world import World, load_world, slug

PYTHON_EVAL = {"type": "function", "function": {
    "name": "python_eval", "description": "Run Python code in the task directory; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
PYTHON_TOOLS = [*TOOLS, PYTHON_EVAL]
EXTRA_FAMILIES = ("chain4", "chain5", "python")

# A python plan: (question, expected answer, verifier, code that prints the answer, task files).
PyPlan = tuple[str, str, str, str, dict[str, str]]


def _search(name: str, attr: str) -> Call:
    return "web_search", {"query": f"{name} {attr}"}


def _sum_expr(values: list[int]) -> str:
    return " + ".join(str(v) for v in values)


def _chain4(rng: random.Random, world: World) -> Plan:
    kind = rng.randrange(4)
    if kind == 0:
        towns = rng.sample(world.towns, 3)
        expr = _sum_expr([t.population for t in towns])
        a, b, c = (t.name for t in towns)
        question = rng.choice(["What is the combined population of {a}, {b} and {c}?",
                               "How many people live in {a}, {b} and {c} together?"]).format(a=a, b=b, c=c)
        return question, calculator(expr), "numeric", [
            *(_search(t.name, "population") for t in towns), ("calculator", {"expression": expr})]
    if kind == 1:
        companies = rng.sample(world.companies, 3)
        expr = _sum_expr([c.employees for c in companies])
        a, b, c = (x.name for x in companies)
        question = rng.choice(["How many employees do {a}, {b} and {c} have in total?",
                               "What is the total number of employees of {a}, {b} and {c}?"]).format(a=a, b=b, c=c)
        return question, calculator(expr), "numeric", [
            *(_search(x.name, "employees") for x in companies), ("calculator", {"expression": expr})]
    if kind == 2:
        company = rng.choice(world.companies)
        home = world.town(company.town)
        other = rng.choice([t for t in world.towns if t.name != home.name])
        expr = f"{home.population} + {other.population}"
        question = (f"What is the combined population of {other.name} and the town where {company.name} "
                    "is based?")
        return question, calculator(expr), "numeric", [
            _search(company.name, "town"), _search(home.name, "population"), _search(other.name, "population"),
            ("calculator", {"expression": expr})]
    services = rng.sample(world.services, 3)
    paths = [f"config/{s.name}.toml" for s in services]
    expr = _sum_expr([s.workers for s in services])
    question = (f"How many workers do the {services[0].name}, {services[1].name} and {services[2].name} services "
                f"have in total? Their configs are {paths[0]}, {paths[1]} and {paths[2]}.")
    return question, calculator(expr), "numeric", [
        *(("read_file", {"path": p}) for p in paths), ("calculator", {"expression": expr})]


def _chain5(rng: random.Random, world: World) -> Plan:
    kind = rng.randrange(4)
    if kind == 0:
        towns = rng.sample(world.towns, 4)
        expr = _sum_expr([t.population for t in towns])
        names = ", ".join(t.name for t in towns[:3]) + f" and {towns[3].name}"
        return f"What is the combined population of {names}?", calculator(expr), "numeric", [
            *(_search(t.name, "population") for t in towns), ("calculator", {"expression": expr})]
    if kind == 1:
        p1, p2 = _pair(rng, world.people, lambda a, b: a.town != b.town)
        t1, t2 = world.town(p1.town), world.town(p2.town)
        expr = f"{t1.population} + {t2.population}"
        question = f"What is the combined population of the towns where {p1.name} and {p2.name} live?"
        return question, calculator(expr), "numeric", [
            _search(p1.name, "town"), _search(p2.name, "town"), _search(t1.name, "population"),
            _search(t2.name, "population"), ("calculator", {"expression": expr})]
    if kind == 2:
        *companies, store = rng.sample(world.companies, 4)
        item, count = rng.choice(sorted(store.stock.items()))
        path = f"notes/{slug(store.name)}.txt"
        expr = _sum_expr([c.employees for c in companies] + [count])
        a, b, c = (x.name for x in companies)
        question = (f"Add up the employees of {a}, {b} and {c} and the number of {item} {store.name} has in "
                    f"stock (see {path}). What is the total?")
        return question, calculator(expr), "numeric", [
            *(_search(x.name, "employees") for x in companies), ("read_file", {"path": path}),
            ("calculator", {"expression": expr})]
    c1, c2 = _pair(rng, world.companies, lambda a, b: world.town(a.town).population != world.town(b.town).population)
    t1, t2 = world.town(c1.town), world.town(c2.town)
    big, small = (t1, t2) if t1.population > t2.population else (t2, t1)
    expr = f"{big.population} - {small.population}"
    question = (f"By how many inhabitants do the populations of the towns where {c1.name} and {c2.name} are "
                "based differ?")
    return question, calculator(expr), "numeric", [
        _search(c1.name, "town"), _search(c2.name, "town"), _search(t1.name, "population"),
        _search(t2.name, "population"), ("calculator", {"expression": expr})]


def _pair(rng: random.Random, items: list, ok: Callable[[Any, Any], bool]) -> tuple[Any, Any]:
    """Two distinct items for which `ok` holds, drawn until they do."""
    while True:
        a, b = rng.sample(items, 2)
        if ok(a, b):
            return a, b


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _divisor_count(n: int) -> int:
    count, p = 1, 2
    while p * p <= n:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        count *= e + 1
        p += 1
    return count * (2 if n > 1 else 1)


def _sum_multiples(a: int, b: int, n: int) -> int:
    def tri(k: int) -> int:  # k + 2k + ... below n
        m = (n - 1) // k
        return k * m * (m + 1) // 2
    lcm = a * b // _gcd(a, b)
    return tri(a) + tri(b) - tri(lcm)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


_USE = " Use python_eval."


def _python(rng: random.Random, world: World) -> PyPlan:
    """A question whose answer the gold code prints; the answer is computed here another way."""
    kind = rng.randrange(8)
    if kind == 0:
        n = rng.randint(20, 70)
        code = f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nprint(a)\n"
        return f"What is the {_ordinal(n)} Fibonacci number, with F(1) = F(2) = 1?{_USE}", str(_fib(n)), \
            "numeric", code, {}
    if kind == 1:
        n = rng.randint(100, 5000)
        count = sum(1 for k in range(2, n) if all(k % d for d in range(2, isqrt(k) + 1)))
        code = (f"n = {n}\nsieve = [True] * n\nsieve[0] = sieve[1] = False\n"
                "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n"
                "        for j in range(i * i, n, i):\n            sieve[j] = False\nprint(sum(sieve))\n")
        return f"How many prime numbers are below {n}?{_USE}", str(count), "numeric", code, {}
    if kind == 2:
        k = rng.randint(50, 500)
        code = f"print(sum(int(d) for d in str(2 ** {k})))\n"
        return f"What is the sum of the decimal digits of 2 to the power {k}?{_USE}", \
            str(sum(map(int, str(2 ** k)))), "numeric", code, {}
    if kind == 3:
        a, b = sorted(rng.sample([3, 4, 5, 6, 7, 11], 2))
        n = rng.randint(100, 10000)
        code = f"print(sum(k for k in range({n}) if k % {a} == 0 or k % {b} == 0))\n"
        return f"What is the sum of all natural numbers below {n} that are multiples of {a} or {b}?{_USE}", \
            str(_sum_multiples(a, b, n)), "numeric", code, {}
    if kind == 4:
        n = rng.randint(10, 10000)
        code = (f"n, steps = {n}, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
                "    steps += 1\nprint(steps)\n")
        return (f"Starting from {n}, how many steps of the Collatz map (halve if even, else 3n + 1) does it take "
                f"to reach 1?{_USE}"), str(_collatz_steps(n)), "numeric", code, {}
    if kind == 5:
        n = rng.randint(1000, 100000)
        code = f"n = {n}\nprint(sum(1 for d in range(1, n + 1) if n % d == 0))\n"
        return f"How many positive divisors does {n} have?{_USE}", str(_divisor_count(n)), "numeric", code, {}
    if kind == 6:
        n = rng.randint(5, 16)
        total = sum(Fraction(1, k) for k in range(1, n + 1))
        code = f"from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, {n} + 1)))\n"
        return (f"Write 1/1 + 1/2 + ... + 1/{n} as a fraction in lowest terms.{_USE}",
                f"{total.numerator}/{total.denominator}", "math", code, {})
    rows = [(rng.choice(_GOODS), rng.randint(1, 99), rng.randint(2, 60)) for _ in range(rng.randint(12, 24))]
    path = "data/orders.csv"
    files = {path: "item,qty,unit_price\n" + "".join(f"{i},{q},{p}\n" for i, q, p in rows)}
    head = "import csv\nrows = list(csv.DictReader(open('data/orders.csv')))\n"
    if rng.random() < 0.5:
        code = head + "print(sum(int(r['qty']) * int(r['unit_price']) for r in rows))\n"
        return (f"What is the total value of the orders in {path}, summing qty times unit_price over all rows?{_USE}",
                str(sum(q * p for _, q, p in rows)), "numeric", code, files)
    item = rng.choice(sorted({i for i, _, _ in rows}))
    code = head + f"print(sum(int(r['qty']) for r in rows if r['item'] == {item!r}))\n"
    return (f"How many {item} were ordered in total according to {path}?{_USE}",
            str(sum(q for i, q, _ in rows if i == item)), "numeric", code, files)


_GOODS = ["lanterns", "ropes", "anvils", "barrels", "spools", "crates", "nails", "kettles"]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


CHAIN_BUILDERS: dict[str, Callable[[random.Random, World], Plan]] = {"chain4": _chain4, "chain5": _chain5}


_TOKEN = re.compile(r"\d+|[A-Z][A-Za-z]+|[\w-]+/[\w./-]+")


def check_grounded(question: str, calls: list[Call], outputs: list[str]) -> None:
    """Raise ValueError unless every call after the first uses only what the question and the earlier
    tool results say (numbers, capitalised names, paths), and every search returns the document of
    the entity it names ('<entity> <attribute>'). The first calculator call may rewrite the question's
    words as digits, so its numbers are not checked."""
    for k, (name, args) in enumerate(calls):
        seen = question + "\n" + "\n".join(outputs[:k])
        if not (k == 0 and name == "calculator"):
            for value in args.values():
                missing = [tok for tok in _TOKEN.findall(str(value)) if tok not in seen]
                if missing:
                    raise ValueError(f"call {k} ({name}) uses {missing}, which nothing before it says")
        if name == "web_search":
            entity = args["query"].rsplit(" ", 1)[0]
            if not any(line.startswith(f"{entity}: ") for line in outputs[k].splitlines()):
                raise ValueError(f"call {k}: web_search {args['query']!r} does not return {entity!r}")


def make_task(family: str, seed: int, index: int, world: World | None = None) -> Task:
    """Task `index` of `family` under `seed`: a training family of `families.py` or one of
    EXTRA_FAMILIES (independent of how many others are generated)."""
    world = world or load_world()
    if family not in EXTRA_FAMILIES:
        return make_family_task(family, seed, index, world)
    rng = random.Random(f"{family}/{seed}/{index}")
    task_id = f"{family}-{seed}-{index}"
    if family == "python":
        question, expected, verifier, code, files = _python(rng, world)
        call = {"id": "call_0", "type": "function", "function": {"name": "python_eval", "arguments": {"code": code}}}
        gold = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "name": "python_eval", "content": expected},
                {"role": "assistant", "content": expected}]
        return Task(id=task_id, family=family, messages=_messages(question), tools=PYTHON_TOOLS, files=files,
                    expected=expected, verifier=verifier, gold=gold)
    question, expected, verifier, calls = CHAIN_BUILDERS[family](rng, world)
    files = _task_files(rng, world, calls)
    check_grounded(question, calls, [run_tool(n, a, world=world, files=files) for n, a in calls])
    return Task(id=task_id, family=family, messages=_messages(question), tools=TOOLS, files=files,
                expected=expected, verifier=verifier,
                gold=gold_trajectory(calls, expected, verifier, world=world, files=files))


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
