"""The wide built-in prompt set (``--prompt-set wide``): the v1 set plus thousands of templated prompts.

Families: every instruction form × every topic, long answers (essays, guides, histories), lists with
explanations, checklists and comparisons, code in more languages (functions, classes, tests, bug fixes,
SQL and shell), questions and explanations for every audience, word problems of several kinds, persona
system prompts and multi-turn conversations (message lists with a short templated assistant turn).
Everything is a pure function of fixed seeds, so the set and its hash are the same on every machine.
"""

from __future__ import annotations

import random

from dmtd.train import prompts as v1

Message = dict[str, str]
WidePrompt = str | list[Message]

LONG_FORMS = [
    "Write a detailed essay of about 400 words on {x}.",
    "Describe the history of {x} in detail, from the beginning to today.",
    "Write a long, vivid description of {x} for a travel magazine.",
    "Write a detailed report on {x} with an introduction, three sections and a conclusion.",
    "Write a blog post of several paragraphs about {x}.",
    "Write a lesson plan for teaching children about {x}.",
]
GUIDES = [
    "Write a step-by-step guide to {x}.",
    "Make a detailed four-week plan for {x}.",
    "Explain, in numbered steps, how a beginner should approach {x}.",
    "Write a checklist for {x}.",
]
LIST_FORMS = [
    "List {n} {x} and explain each in one sentence.",
    "Make a numbered list of {n} {x}.",
    "Name {n} {x}, from the best known to the least known.",
    "Give me a bulleted list of {n} {x} with a short note on each.",
]
QUESTIONS = [
    "How did {x} change the world?", "What are the pros and cons of {x}?", "What is the future of {x}?",
    "What are some common myths about {x}?", "Who should learn about {x}, and why?",
    "Describe {x} in exactly five sentences.", "What would a world without {x} look like?",
]
EXPLAIN = [
    "Explain {x} to {a}.", "What is the difference between {x} and {y}?", "Compare {x} and {y} in a table.",
    "Give a real-world example of {x}.", "What are the most common misconceptions about {x}?",
    "Explain {x} step by step, then summarise it in one sentence.",
]
MORE_LANGUAGES = ["Python", "JavaScript", "TypeScript", "Rust", "Go", "C", "C++", "Java", "Ruby", "Bash"]
CLASSES = ["a bank account", "a to-do list", "a shopping cart", "a stack", "a queue", "a library catalogue",
           "a temperature sensor", "a deck of cards", "a simple calculator", "a contact book", "a timer",
           "a matrix", "an inventory of products", "a rate limiter", "a linked list"]
BUGGY = [
    "def average(xs):\n    return sum(xs) / len(xs) + 1",
    "def is_even(n):\n    return n % 2 == 1",
    "for i in range(10):\n    if i = 5:\n        print(i)",
    "function last(arr) {\n  return arr[arr.length];\n}",
    "def count(s, c):\n    n = 0\n    for ch in s:\n        if ch == c:\n            n =+ 1\n    return n",
    "def reverse(xs):\n    for i in range(len(xs)):\n        xs[i] = xs[len(xs) - i]\n    return xs",
    "int main() {\n  int a[3] = {1, 2, 3};\n  for (int i = 0; i <= 3; i++) printf(\"%d\", a[i]);\n}",
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)",
]
TABLES = [("employees", "id, name, department, salary, hired_at"), ("orders", "id, customer_id, total, created_at"),
          ("books", "id, title, author, year, genre"), ("students", "id, name, grade, city"),
          ("products", "id, name, price, stock, category")]
SQL_TASKS = ["the five most recent rows", "the average of the numeric column per group",
             "the rows added in the last 30 days", "the number of rows per category",
             "duplicate names", "the row with the highest value"]
SHELL_TASKS = ["find all files larger than 100 MB", "count the lines in every .py file", "show the ten "
               "largest directories", "replace a word in many files", "archive a folder with tar and gzip",
               "watch a log file for errors", "list processes using the most memory", "rename files to "
               "lowercase"]
PERSONAS = ["a patient maths tutor", "a friendly chef", "a concise technical writer", "an enthusiastic "
            "travel guide", "a careful financial adviser", "a kind primary school teacher", "a senior "
            "software engineer", "a fitness coach", "a museum curator", "a science journalist"]
FOLLOW_UPS = ["Can you give me an example?", "Explain that more simply.", "Now make it shorter.",
              "What is the most important point?", "Can you turn that into a list?", "Why is that?",
              "Tell me more about the second point.", "How would I explain this to a child?"]
TIMES = ["two hours", "thirty minutes a day", "one evening", "the weekends"]
LEVELS = ["a complete beginner", "someone who tried once and gave up", "fairly experienced",
          "starting again after many years"]


def _word_problems(r: random.Random) -> list[str]:
    out = []
    for _ in range(80):
        a, b = r.randint(20, 400), r.randint(5, 60)
        out.append(f"A shop sells a jacket for {a} dollars and gives a {b}% discount. What is the new price? "
                   "Show your working.")
    for _ in range(80):
        d, t = r.randint(30, 600), r.randint(1, 9)
        out.append(f"A train travels {d} km in {t} hours. What is its average speed, and how far does it "
                   f"go in {t + 2} hours at that speed?")
    for _ in range(80):
        w, h = r.randint(2, 40), r.randint(2, 40)
        out.append(f"A garden is {w} m long and {h} m wide. What are its area and perimeter? "
                   "Explain step by step.")
    for _ in range(80):
        n, m = r.choice(v1.NAMES), r.choice(v1.NAMES)
        a, k = r.randint(2, 20), r.randint(2, 5)
        out.append(f"{n} is {a} years old and {m} is {k} times as old. How old will {m} be when {n} is "
                   f"{a * 2}? Think it through.")
    for _ in range(80):
        a, b, c = r.randint(2, 50), r.randint(2, 50), r.randint(2, 9)
        out.append(f"Solve for x: {c}x + {a} = {b + a + c}. Explain each step.")
    return out


def _conversations(r: random.Random) -> list[list[Message]]:
    out: list[list[Message]] = []

    def conv(*turns: str) -> list[Message]:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]

    for topic in v1.TOPICS:
        for follow in r.sample(["Its history.", "Why it matters today.", "Some surprising facts.",
                                "How it works, simply explained.", "What people get wrong about it."], 3):
            out.append(conv(f"Tell me about {topic}.",
                            f"Happy to! {topic[0].upper() + topic[1:]} is a big subject. Which part interests "
                            "you most?", follow))
    for act in v1.ACTIVITIES:
        for level, time in zip(r.sample(LEVELS, 2), r.sample(TIMES, 2)):
            out.append(conv(f"I want to get better at {act}.",
                            "Great goal! Tell me a bit about where you are now and how much time you have.",
                            f"I'm {level} and I have {time}. What should I do?"))
    for task in v1.CODE_TASKS:
        lang = r.choice(MORE_LANGUAGES)
        out.append(conv(f"I need code that {task}.", "Sure. Which language would you like it in?",
                        f"{lang}, please, with comments."))
    for c in v1.CONCEPTS:
        out.append(conv(f"What is {c}?", f"In short, {c} is a key idea in its field. Would you like a "
                        "deeper explanation or an example?", r.choice(FOLLOW_UPS)))
    for persona in PERSONAS:
        for q in r.sample(v1.CHAT + [f"Explain {c}." for c in v1.CONCEPTS], 12):
            out.append([{"role": "system", "content": f"You are {persona}."}, {"role": "user", "content": q}])
    return out


def wide_prompts() -> list[WidePrompt]:
    """The v1 prompts first (same order), then the wide families, interleaved, without duplicates."""
    r = random.Random(20261201)
    fam: dict[str, list[WidePrompt]] = {k: [] for k in ("instruction", "long", "list", "question", "explain",
                                                         "code", "math", "conversation")}
    for form in v1.FORMS:
        fam["instruction"] += [f"Write {form} about {x}." for x in v1.TOPICS]
    for tpl in LONG_FORMS:
        fam["long"] += [tpl.format(x=x) for x in v1.TOPICS]
    for tpl in GUIDES:
        fam["long"] += [tpl.format(x=x) for x in v1.ACTIVITIES]
    for tpl in LIST_FORMS:
        fam["list"] += [tpl.format(n=r.choice(["three", "five", "seven", "ten"]), x=x) for x in v1.LIST_THINGS]
    fam["question"] += [tpl.format(x=x) for tpl in QUESTIONS for x in v1.TOPICS]
    for c in v1.CONCEPTS:
        others = [o for o in v1.CONCEPTS if o != c]
        for tpl in EXPLAIN:
            fam["explain"].append(tpl.format(x=c, y=r.choice(others), a=r.choice(v1.AUDIENCES)))
        fam["explain"] += [f"Explain {c} to {a}." for a in v1.AUDIENCES]
    for task in v1.CODE_TASKS:
        fam["code"] += [f"Write a {lang} function that {task}." for lang in MORE_LANGUAGES]
        fam["code"] += [f"Write unit tests for a Python function that {task}.",
                        f"Write a {r.choice(MORE_LANGUAGES)} function that {task}, with a docstring and "
                        "an example of how to call it."]
    for cls in CLASSES:
        fam["code"] += [f"Write a {lang} class that models {cls}." for lang in r.sample(MORE_LANGUAGES, 4)]
    for snip in BUGGY:
        fam["code"] += [f"Find and fix the bug in this code:\n\n{snip}", f"Review this code:\n\n{snip}"]
    for table, cols in TABLES:
        fam["code"] += [f"Write an SQL query on a table {table}({cols}) that returns {t}." for t in SQL_TASKS]
    fam["code"] += [f"Give me a shell command to {t}, and explain it." for t in SHELL_TASKS]
    fam["math"] += _word_problems(r)
    fam["conversation"] += _conversations(r)
    seen: set[str] = set()
    out: list[WidePrompt] = []

    def add(p: WidePrompt) -> None:
        key = p if isinstance(p, str) else repr(p)
        if key not in seen:
            seen.add(key)
            out.append(p)

    for p in v1.builtin_prompts():
        add(p)
    for f in fam.values():
        r.shuffle(f)
    for i in range(max(len(f) for f in fam.values())):
        for f in fam.values():
            if i < len(f):
                add(f[i])
    return out
