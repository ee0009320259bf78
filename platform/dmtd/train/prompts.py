"""The built-in prompt set for self-distillation corpora: varied user turns written for this project.

Categories: instructions, questions, explanations, lists, stories, code, chat, maths, rewriting and
advice. Templates are combined with topic lists and a fixed-seed sampler, so the set is the same on
every machine (its content hash is part of every corpus manifest).
"""

from __future__ import annotations

import hashlib
import json
import random

TOPICS = [
    "the ocean", "volcanoes", "the moon", "honey bees", "the printing press", "electric cars", "rainforests",
    "the Roman Empire", "coffee", "chess", "photosynthesis", "black holes", "the internet", "bicycles",
    "ancient Egypt", "recycling", "the human heart", "jazz music", "mountains", "trains", "the desert",
    "friendship", "winter", "gardening", "robots", "dinosaurs", "the solar system", "libraries",
    "the Olympic Games", "bread baking", "earthquakes", "whales", "the Renaissance", "clouds", "democracy",
    "vaccines", "the Great Wall of China", "owls", "video games", "tea", "lighthouses", "rivers",
    "solar panels", "the stock market", "origami", "the immune system", "castles", "penguins", "typewriters",
    "climate change", "a city at night", "autumn leaves", "space exploration", "museums", "pirates",
    "the piano", "football", "deserts at night", "a small village", "the first airplane",
]

CONCEPTS = [
    "gravity", "inflation", "machine learning", "the water cycle", "supply and demand", "evolution",
    "a neural network", "compound interest", "the greenhouse effect", "DNA", "a blockchain", "entropy",
    "democracy", "photosynthesis", "an API", "a recursive function", "the Pythagorean theorem", "plate tectonics",
    "an electric circuit", "the scientific method", "a hash table", "opportunity cost", "the immune response",
    "a black hole", "the speed of light", "a database index", "natural selection", "a vaccine", "cloud computing",
    "the placebo effect", "a compiler", "the food chain", "ocean tides", "a budget", "version control",
    "the Big Bang", "an operating system", "probability", "a metaphor", "global trade", "public key encryption",
    "the nervous system", "a sorting algorithm", "interest rates", "renewable energy", "a prime number",
    "the Doppler effect", "time zones", "a caching layer", "sleep cycles",
]

AUDIENCES = ["a five-year-old", "a high school student", "a complete beginner", "a busy manager",
             "a curious grandparent", "a university student", "someone who speaks little English"]

FORMS = ["a short poem", "a haiku", "a limerick", "a product description", "a short speech", "a diary entry",
         "a news headline and summary", "a motivational quote", "a riddle", "a short dialogue",
         "a postcard message", "a tweet", "a song chorus", "a fun fact", "a two-sentence horror story"]

CHARACTERS = ["a lonely robot", "a brave little mouse", "an old fisherman", "a curious girl", "a talking cat",
              "a retired astronaut", "a young wizard", "a baker", "a lost dog", "a shy dragon", "twin detectives",
              "a time traveller", "a village teacher", "a street musician", "a penguin chef", "a ghost"]

EVENTS = ["finds a mysterious map", "learns to fly", "meets a new friend", "loses something important",
          "discovers a hidden door", "wins a contest", "gets lost in a storm", "builds a machine",
          "opens a small shop", "receives a strange letter", "travels to the moon", "saves the town"]

ACTIVITIES = ["learning a new language", "running a marathon", "saving money", "studying for exams",
              "cooking at home", "staying focused", "starting a garden", "sleeping better", "public speaking",
              "writing a resume", "travelling on a budget", "learning to code", "staying healthy at work",
              "taking care of a puppy", "organising a small event", "reducing stress", "reading more books",
              "making friends in a new city", "keeping a clean kitchen", "preparing for a job interview"]

LIST_THINGS = ["fruits that are rich in vitamin C", "famous inventors", "programming languages", "board games",
               "countries in Africa", "things to pack for a camping trip", "healthy breakfast ideas",
               "classic novels", "musical instruments", "ways to save energy at home", "birds", "planets",
               "careers in science", "hobbies to try this year", "kitchen tools", "rainy day activities",
               "questions to ask in an interview", "sources of protein", "famous bridges", "types of clouds",
               "uses for a paper clip", "ancient wonders of the world", "habits of productive people",
               "ideas for a birthday party", "ways to reduce plastic waste"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the nth Fibonacci number",
    "counts the vowels in a string", "finds the largest element in a list", "removes duplicates from a list",
    "checks whether a word is a palindrome", "computes the factorial of n", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "flattens a nested list", "counts word frequencies in a text",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "sums the digits of an integer", "implements binary search", "sorts a list with bubble sort",
    "computes the greatest common divisor of two numbers", "validates an email address with a regex",
    "reads a CSV file and prints each row", "computes the average of a list of numbers",
    "transposes a matrix", "capitalises the first letter of every word", "generates a random password",
    "finds all even numbers in a list", "converts a decimal number to binary", "rotates a list by k steps",
    "returns the unique characters of a string", "checks if a year is a leap year", "chunks a list into pieces",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Rust", "Go", "C", "Java"]

SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else "
    "'Buzz' if i % 5 == 0 else i)",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
    "const add = (a, b) => a + b;\nconsole.log([1, 2, 3].reduce(add, 0));",
    "x = {}\nfor word in text.split():\n    x[word] = x.get(word, 0) + 1",
    "git checkout -b feature && git commit -am 'wip' && git push -u origin feature",
    "with open('data.txt') as f:\n    lines = [l.strip() for l in f if l.strip()]",
    "def fact(n):\n    return 1 if n <= 1 else n * fact(n - 1)",
    "ls -la | grep '.py' | wc -l",
    "import numpy as np\na = np.arange(12).reshape(3, 4)\nprint(a.sum(axis=0))",
]

CHAT = [
    "Hi! How are you today?", "Can you recommend a good book for the weekend?", "I'm bored. Any ideas?",
    "What should I cook for dinner tonight?", "Tell me a joke.", "Tell me something interesting.",
    "I just got a new puppy! Any tips?", "What's your favourite season and why?", "Good morning!",
    "Can you help me plan my day?", "I feel a bit stressed about work.", "What's a fun fact about space?",
    "Do you like music?", "What's a good name for a goldfish?", "I want to learn something new this week.",
    "Can you cheer me up?", "What's the best way to start learning guitar?", "Thanks for your help earlier!",
    "Suggest a movie for a family night.", "What do you think makes a good friend?",
    "I'm going to Paris next month. What should I see?", "Can you give me a random word and its meaning?",
    "How do I make my mornings less rushed?", "What are you able to help me with?",
    "I have a job interview tomorrow.", "Recommend a hobby I can do indoors.", "Who are you?",
    "Say something kind to me.", "What's a good stretch to do at my desk?", "Help me pick a gift for my mom.",
]

REWRITE_TEXTS = [
    "the meeting have been moved to thursday because many people was not available on monday",
    "Our company is committed to delivering high quality products to customers around the world every day.",
    "The cat sat on the mat and looked out of the window at the birds in the garden.",
    "i think we should of left earlier, the traffic were terrible and we was late",
    "Exercise improves mood, sleep and energy, and it lowers the risk of many diseases.",
    "The new library opens on Monday. It has a cafe, a study area and more than fifty thousand books.",
    "Scientists discovered a new species of frog in the rainforest last year.",
    "Please remember to submit your reports before the end of the week.",
]
REWRITE_TASKS = ["Fix the grammar of this sentence: ", "Summarize in one sentence: ", "Make this more formal: ",
                 "Make this sound more friendly: ", "Translate into French: ", "Translate into Spanish: ",
                 "Rewrite this as a question: ", "Turn this into a bullet list: "]

NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luis"]
ITEMS = ["apples", "books", "pencils", "marbles", "cookies", "stickers", "oranges", "coins"]


def _templates(r: random.Random) -> dict[str, list[str]]:
    def t(s: str, **kw: str) -> str:
        return s.format(**kw)

    out: dict[str, list[str]] = {k: [] for k in (
        "instruction", "question", "explanation", "list", "story", "code", "chat", "math", "rewrite", "advice")}
    for form in FORMS:
        for topic in r.sample(TOPICS, 8):
            out["instruction"].append(t("Write {f} about {x}.", f=form, x=topic))
    for topic in TOPICS:
        out["question"] += [t("What is the most interesting thing about {x}?", x=topic),
                            t("Why are people fascinated by {x}?", x=topic),
                            t("Give me three facts about {x}.", x=topic)]
    for c in CONCEPTS:
        out["question"].append(t("What is {x}?", x=c))
        out["explanation"] += [t("Explain {x} to {a}.", x=c, a=r.choice(AUDIENCES)),
                               t("How does {x} work? Keep it short.", x=c),
                               t("Explain {x} with a simple analogy.", x=c)]
    for thing in LIST_THINGS:
        for n in r.sample(["three", "five", "seven", "ten"], 2):
            out["list"].append(t("List {n} {x}.", n=n, x=thing))
    for act in ACTIVITIES:
        out["list"].append(t("Give me five tips for {x}.", x=act))
        out["advice"] += [t("What are common mistakes people make when {x}?", x=act),
                          t("I want to get better at {x}. Where should I start?", x=act)]
    for ch in CHARACTERS:
        for ev in r.sample(EVENTS, 5):
            out["story"].append(t("Write a short story about {c} who {e}.", c=ch, e=ev))
    for task in CODE_TASKS:
        for lang in r.sample(LANGUAGES, 3):
            out["code"].append(t("Write a {l} function that {x}.", l=lang, x=task))
        out["code"].append(t("How would you write code that {x}? Explain the approach.", x=task))
    for snip in SNIPPETS:
        out["code"] += [f"Explain what this code does:\n\n{snip}", f"How could this code be improved?\n\n{snip}"]
    out["chat"] += CHAT
    for _ in range(60):
        a, b = r.randint(3, 99), r.randint(3, 99)
        op = r.choice(["plus", "minus", "times"])
        out["math"].append(f"What is {a} {op} {b}?")
    for _ in range(60):
        n, i = r.choice(NAMES), r.choice(ITEMS)
        a, b = r.randint(2, 30), r.randint(1, 15)
        out["math"].append(f"{n} has {a} {i} and buys {b} more, then gives away {min(a, b)}. "
                           f"How many {i} does {n} have now? Explain step by step.")
    for text in REWRITE_TEXTS:
        for task in r.sample(REWRITE_TASKS, 5):
            out["rewrite"].append(task + text)
    return out


def builtin_prompts() -> list[str]:
    """All built-in user turns (about 1,000), in a fixed, category-interleaved order."""
    r = random.Random(20251014)
    cats = _templates(r)
    seen: set[str] = set()
    prompts = []
    for c in cats.values():
        r.shuffle(c)
    longest = max(len(c) for c in cats.values())
    for i in range(longest):
        for c in cats.values():
            if i < len(c) and c[i] not in seen:
                seen.add(c[i])
                prompts.append(c[i])
    return prompts


def prompts_hash(prompts: list[str] | list[list[dict[str, str]]]) -> str:
    """SHA-256 of a prompt list, for corpus manifests."""
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()
