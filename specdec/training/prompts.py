"""Training prompts written from what this machine has: templates over topic lists, and the
Python standard library's own source and docstrings. Never the evaluation set
(specdec/assets/prompts/dev_prompts.jsonl): a draft or heads trained on it would flatter every figure.

`training_prompts(seed)` is deterministic: the same seed gives the same prompts in the same
order, so generation can resume by prompt index.
"""

from __future__ import annotations

import importlib
import inspect
import random
import sys
import textwrap
from dataclasses import dataclass

TOPICS = [
    "the ocean", "a city at night", "autumn leaves", "a lost dog", "friendship", "a rainy Monday", "space travel",
    "an old library", "learning to cook", "a mountain village", "the first day of school", "a robot that dreams",
    "a summer festival", "a lighthouse keeper", "time management", "a busy train station", "gardening",
    "a snowstorm", "a jazz musician", "the history of bread", "honeybees", "a desert road trip", "a chess match",
    "climate change", "a small bakery", "volunteering", "a haunted house", "remote work", "a marathon",
    "the moon landing", "a family reunion", "electric cars", "a forgotten letter", "a coffee shop", "wildfires",
    "a music teacher", "the internet", "a birthday surprise", "recycling", "a street market",
]
FORMS = ["short poem", "short story", "friendly email", "formal letter", "speech", "product description",
         "blog post introduction", "diary entry", "limerick", "short dialogue", "news headline and summary"]
ADVICE = ["staying focused while studying", "saving money", "sleeping better", "learning a new language",
          "public speaking", "running a first 5k", "writing a cover letter", "keeping houseplants alive",
          "making friends in a new city", "preparing for a job interview", "reducing stress",
          "organising a small event", "starting to exercise", "cooking on a budget", "traveling light"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "merges two sorted lists", "counts the words in a text", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "flattens a nested list", "checks whether a string is a palindrome",
    "finds the largest element of a list without using max", "converts Celsius to Fahrenheit",
    "returns the greatest common divisor of two integers", "parses a CSV line into fields",
    "computes the mean and median of a list", "implements binary search", "sorts a list with insertion sort",
    "counts vowels in a string", "transposes a matrix given as a list of lists", "validates an email address",
    "returns all permutations of a list", "groups words by their first letter", "computes a running sum",
    "checks if two strings are anagrams", "converts a Roman numeral to an integer", "chunks a list into pieces of size n",
    "reads a text file and returns its lines without newlines", "implements a stack class", "computes the dot product",
    "finds the second largest number", "capitalizes every word in a sentence", "implements a simple LRU cache",
    "returns the intersection of two lists", "computes the power set of a set", "rotates a list by k positions",
    "counts character frequencies", "checks balanced parentheses", "converts an integer to binary",
    "computes the Levenshtein distance", "finds the longest common prefix of strings", "generates primes below n",
]
LANGS = ["Python", "JavaScript", "C", "Java", "Go", "Rust", "Bash"]
CONCEPTS = [
    "photosynthesis", "inflation", "a black hole", "machine learning", "the water cycle", "democracy",
    "compound interest", "DNA", "gravity", "the stock market", "a vaccine", "an operating system", "entropy",
    "the French Revolution", "plate tectonics", "a neural network", "supply and demand", "the immune system",
    "renewable energy", "the Pythagorean theorem", "an API", "encryption", "evolution", "the Roman Empire",
    "a database index", "climate", "a recession", "quantum computing", "the greenhouse effect", "blockchain",
]
TRANSLATE_TO = ["French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese"]
SENTENCES = [
    "The weather is beautiful today.", "I would like to book a table for two.", "Where is the nearest train station?",
    "She has been reading that book for weeks.", "Please send me the report by Friday.",
    "The children are playing in the garden.", "We are going to the museum tomorrow.",
    "This restaurant serves the best soup in town.", "Could you help me carry these boxes?",
    "He forgot his umbrella at the office.", "The meeting has been moved to next Tuesday.",
    "My grandmother grows tomatoes every summer.", "The concert starts at eight o'clock.",
    "I have never seen such a large dog.", "Turn left after the bridge and continue straight.",
    "Thank you for your patience and understanding.", "The price of coffee has gone up again.",
    "Our team won the match last night.", "It is important to drink enough water.",
    "The library closes early on Sundays.",
]


@dataclass(frozen=True)
class TrainingPrompt:
    category: str
    text: str


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 12)
    templates = [
        f"A shop sells pencils at ${c} each. Maria buys {a} pencils and pays with a ${a * c + b} bill. How much change does she get?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed in km per hour?",
        f"Tom has {a} marbles. He gives {min(b, a)} to his sister and then buys {c} more. How many marbles does he have now?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"A recipe needs {c} eggs for {b} cookies. How many eggs are needed for {b * a} cookies?",
        f"There are {a} students in a class and {b}% of them wear glasses. How many students wear glasses?",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"A tank holds {a * 100} liters and leaks {c} liters per hour. How long until it holds {a * 50} liters?",
        f"What is {a} multiplied by {b}, minus {c}? Show your steps.",
        f"Anna reads {c} pages a day. How many days does she need to finish a book of {c * a + b} pages?",
    ]
    return rng.choice(templates) + " Explain your reasoning step by step."


def _stdlib_items() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(module name, module docstring) and (qualified name, signature line, docstring) from the stdlib."""
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "pydoc_data"}
    modules, functions = [], []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in skip:
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:  # platform-specific modules
            continue
        doc = inspect.getdoc(mod)
        if doc and len(doc) > 300:
            modules.append((name, doc))
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != name:
                continue
            fdoc = inspect.getdoc(obj)
            if not fdoc or len(fdoc) < 40:
                continue
            try:
                sig = f"def {attr}{inspect.signature(obj)}:"
            except (TypeError, ValueError):
                continue
            functions.append((f"{name}.{attr}", sig, fdoc))
    return modules, functions


def _stdlib_sources(max_lines: int = 40) -> list[tuple[str, str]]:
    """(qualified name, source) of the stdlib's documented functions of 4 to max_lines lines:
    real code written by people, for prompts that read and rework code."""
    out = []
    for name, _, _ in _stdlib_items()[1]:
        module, attr = name.rsplit(".", 1)
        try:
            source = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), attr)))
        except (OSError, TypeError, AttributeError):
            continue
        if 4 <= source.count("\n") <= max_lines:
            out.append((name, source.rstrip()))
    return out


def code_prompts(seed: int = 0, count: int = 600) -> list[TrainingPrompt]:
    """Code prompts (category code), deterministic by seed: complete a stdlib function from its
    signature and docstring (as HumanEval asks), explain, rewrite, document or test a stdlib
    function's real source, write a function from a task in a few languages."""
    rng = random.Random(seed)
    functions, sources = _stdlib_items()[1], _stdlib_sources()
    fence = "```"
    makers = [
        lambda f: f"Complete the following Python function.\n\n{f[1]}\n    \"\"\"{textwrap.shorten(f[2], 400)}\"\"\"\n",
        lambda f: f"{f[1]}\n    \"\"\"{textwrap.shorten(f[2], 300)}\"\"\"\n",
    ]
    reworks = [
        "Explain what this Python function does, step by step.",
        "Rewrite this Python function so that it is easier to read, keeping its behaviour.",
        "Add type hints and a docstring to this Python function.",
        "Write pytest unit tests for this Python function.",
        "Find possible bugs or edge cases in this Python function.",
        "Translate this Python function into JavaScript.",
    ]

    def make(i: int) -> str:
        kind = i % 4
        if kind == 0:
            return rng.choice(makers)(rng.choice(functions))
        if kind == 3:
            return f"Write a {rng.choice(LANGS)} function that {rng.choice(CODE_TASKS)}."
        name, source = rng.choice(sources)
        return f"{rng.choice(reworks)}\n\n{fence}python\n{source}\n{fence}"

    return [TrainingPrompt("code", make(i)) for i in range(count)]


def training_prompts(seed: int = 0, count: int = 2000) -> list[TrainingPrompt]:
    rng = random.Random(seed)
    modules, functions = _stdlib_items()
    makers = {
        "chat": lambda: rng.choice([
            f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}.",
            f"Give me practical tips for {rng.choice(ADVICE)}.",
            f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}. Keep it under 100 words.",
        ]),
        "code": lambda: rng.choice([
            f"Write a {rng.choice(LANGS)} function that {rng.choice(CODE_TASKS)}.",
            f"Write a Python function that {rng.choice(CODE_TASKS)}. Include a docstring and an example.",
            (lambda f: f"Complete the following Python function.\n\n{f[1]}\n    \"\"\"{textwrap.shorten(f[2], 300)}\"\"\"\n")(
                rng.choice(functions)),
        ]),
        "math": lambda: _math_problem(rng),
        "summarization": lambda: (lambda text: f"Summarize the following text in a few sentences.\n\n{text[:700]}")(
            rng.choice([m[1] for m in modules] + [f[2] for f in functions if len(f[2]) > 400])),
        "translation": lambda: f"Translate the following sentence into {rng.choice(TRANSLATE_TO)}: {rng.choice(SENTENCES)}",
        "qa": lambda: rng.choice([f"What is {rng.choice(CONCEPTS)}?", f"Explain {rng.choice(CONCEPTS)} in simple terms.",
                                  f"What are the main differences between {rng.choice(CONCEPTS)} and {rng.choice(CONCEPTS)}?"]),
        "rag": lambda: (lambda f: f"Use the context to answer the question.\n\nContext: {textwrap.shorten(f[2], 400)}\n\n"
                                  f"Question: What does `{f[0]}` do, and how is it called?")(rng.choice(functions)),
    }
    cats = list(makers)
    return [TrainingPrompt(cat, makers[cat]()) for cat in (cats[i % len(cats)] for i in range(count))]
