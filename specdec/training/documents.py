"""Long-context training prompts: documents to summarize, answer questions from, and translate.

The base prompt set (specdec.training.prompts) has short prompts; the long-context categories of
an evaluation (summarizing an article, answering from a passage, translating into English) were
where drafts and heads trained on it did worst. This machine has no news corpus, so the documents
come from what it has, in two stages:

1. `article_prompts(seed, count)`: the target writes news stories and encyclopedia entries from
   templates (its own text is exactly what it will later read).
2. `document_prompts(seed, articles, count)`: over those texts, "Summarize: <article>" and
   "<passage>\\n<question>" prompts; plus "Translate <language> to English: <sentence>" over the
   translated messages of the system's gettext catalogs (/usr/share/locale/<lang>/LC_MESSAGES/*.mo),
   and short factual questions.

Both are deterministic for a seed (generation resumes by prompt index); the documents are built
over the articles present when their generation starts, so make all the articles first. Never
the evaluation set.
"""

from __future__ import annotations

import random
import re
import struct
from pathlib import Path
from typing import Iterable, Sequence

from specdec.training.prompts import CONCEPTS, TrainingPrompt

CITIES = ["Chicago", "Leeds", "Lyon", "Osaka", "Melbourne", "Denver", "Cork", "Porto", "Hamburg", "Austin",
          "Bristol", "Toronto", "Naples", "Seattle", "Glasgow", "Atlanta", "Utrecht", "Perth", "Boston", "Bilbao"]
ANIMALS = ["orangutan", "giraffe", "penguin", "red panda", "elephant", "tiger", "koala", "otter", "rhino", "owl"]
GOODS = ["coffee", "bread", "petrol", "rent", "electricity", "train tickets", "olive oil", "chocolate"]
SPORTS = ["football", "rugby", "basketball", "cricket", "hockey", "volleyball"]
CAUSES = ["a new playground", "a sick classmate", "the local food bank", "flood victims", "a school trip"]
# (news subject, question about it); {city}, {animal}, {good}, {sport}, {cause} are filled in.
NEWS = [
    ("a fire that destroyed a family's home in {city}", "What happened to the family in {city}?"),
    ("a zoo in {city} welcoming a baby {animal}", "Which animal was born at the zoo?"),
    ("{city} opening a new public library", "When does the new library open?"),
    ("a local team from {city} winning the national {sport} championship", "Who won the {sport} championship?"),
    ("a storm causing flooding in {city}", "How much damage did the storm cause in {city}?"),
    ("scientists finding a new species of {animal}", "Where was the new species found?"),
    ("a school in {city} raising money for {cause}", "How much money did the school raise?"),
    ("the price of {good} rising sharply", "Why did the price of {good} rise?"),
    ("hikers rescued from the mountains near {city}", "How were the hikers rescued?"),
    ("a new study on sleep and health", "What did the study find?"),
    ("a {sport} star retiring after twenty years", "Why did the player retire?"),
    ("a mother of six in {city} asking for help after losing her job", "Who is asking for help?"),
    ("a hospital in {city} testing a new treatment", "What treatment is being tested?"),
    ("{city} banning cars from its old town", "When does the ban start?"),
    ("a lost dog walking 100 miles home to {city}", "How far did the dog walk?"),
    ("a rare {animal} spotted in a garden in {city}", "Who spotted the {animal}?"),
]
ENCYCLOPEDIA_QUESTIONS = ["What is {topic}?", "Who first described {topic}?", "Why is {topic} important?",
                          "When was {topic} discovered?", "Where does {topic} come from?"]
PLACES = ["the Amazon River", "Mount Everest", "the Great Barrier Reef", "the Sahara", "Iceland", "the Alps",
          "Venice", "the Nile", "Patagonia", "the Dead Sea", "Kyoto", "the Grand Canyon"]
FACT_QUESTIONS = [
    "Who invented the {x}?", "When was the {x} invented?", "What is the capital of {country}?",
    "What language is spoken in {country}?", "Where is {place}?", "How long is {place}?",
    "Who was the first person to climb {place}?", "What is {topic} used for?", "Who discovered {topic}?",
    "Which country is {place} in?", "What currency does {country} use?", "How many people live in {country}?",
]
INVENTIONS = ["telephone", "printing press", "light bulb", "steam engine", "radio", "microscope", "bicycle",
              "television", "airplane", "compass", "camera", "computer"]
COUNTRIES = ["Brazil", "Kenya", "Norway", "Vietnam", "Peru", "Canada", "Egypt", "Poland", "Chile", "Nepal",
             "Portugal", "Morocco", "New Zealand", "Hungary", "Ghana", "Thailand"]
LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese", "nl": "Dutch"}
LANGUAGE_WEIGHTS = {"de": 4, "fr": 1, "es": 1, "it": 1, "pt": 1, "nl": 1}


def _slots(rng: random.Random) -> dict[str, str]:
    return {"city": rng.choice(CITIES), "animal": rng.choice(ANIMALS), "good": rng.choice(GOODS),
            "sport": rng.choice(SPORTS), "cause": rng.choice(CAUSES), "topic": rng.choice(CONCEPTS),
            "x": rng.choice(INVENTIONS), "country": rng.choice(COUNTRIES), "place": rng.choice(PLACES)}


def article_specs(seed: int, count: int) -> list[tuple[TrainingPrompt, str]]:
    """Stage 1: (prompt asking the target for an article, a question the article should answer)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        slots = _slots(rng)
        if i % 3 == 2:
            topic = rng.choice(CONCEPTS + PLACES)
            prompt = f"Write an encyclopedia article about {topic}, in several paragraphs."
            question = rng.choice(ENCYCLOPEDIA_QUESTIONS).format(topic=topic)
        else:
            subject, question = rng.choice(NEWS)
            prompt = f"Write a news article about {subject.format(**slots)}. Include quotes from the people involved."
            question = question.format(**slots)
        out.append((TrainingPrompt("article", prompt), question))
    return out


def article_prompts(seed: int = 0, count: int = 240) -> list[TrainingPrompt]:
    return [p for p, _ in article_specs(seed, count)]


def mo_messages(path: Path) -> list[str]:
    """The translated strings of a GNU gettext .mo catalog (format: gettext manual, "MO Files")."""
    data = Path(path).read_bytes()
    if len(data) < 20:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        return []
    n, _, trans_off = struct.unpack(order + "3I", data[8:20])
    out = []
    for i in range(n):
        length, off = struct.unpack(order + "2I", data[trans_off + 8 * i : trans_off + 8 * i + 8])
        for text in data[off : off + length].split(b"\x00"):  # plural forms are NUL-separated
            try:
                out.append(text.decode("utf-8"))
            except UnicodeDecodeError:
                pass
    return out


_SENTENCE = re.compile(r"^[^\W\d_][^%{}<>\[\]\\|`$\n\t=_/*]{30,220}[.!?]$")


def foreign_sentences(lang: str, locale_dir: Path = Path("/usr/share/locale")) -> list[str]:
    """Sentence-like translated messages of every catalog for `lang` on this system, sorted and
    deduplicated (empty where the system has none)."""
    found: set[str] = set()
    for mo in sorted((Path(locale_dir) / lang / "LC_MESSAGES").glob("*.mo")):
        for text in mo_messages(mo):  # one-line messages only: multi-line ones are usage texts
            text = text.strip()
            if _SENTENCE.match(text) and text.count(" ") >= 4 and "--" not in text:
                found.add(text)
    return sorted(found)


def document_prompts(seed: int, articles: Sequence[tuple[str, str]], count: int,
                     sentences: dict[str, list[str]]) -> list[TrainingPrompt]:
    """Stage 2 over (article text, question) pairs and {language: sentences}: summarization, rag,
    translation and qa prompts in turn (a category without material is skipped)."""
    rng = random.Random(seed)
    langs = [lang for lang in LANGUAGE_WEIGHTS if sentences.get(lang)]
    makers = {}
    if articles:
        makers["summarization"] = lambda a: rng.choice(["Summarize: {t}", "Summarize the following article.\n\n{t}",
                                                        "{t}\n\nSummarize the article above in a few sentences."]
                                                       ).format(t=a[0])
        makers["rag"] = lambda a: rng.choice(["{t}\n{q}", "{t}\n\nAnswer using the text above: {q}"]
                                             ).format(t=a[0], q=a[1])
    if langs:
        def translate(_):
            lang = rng.choices(langs, weights=[LANGUAGE_WEIGHTS[x] for x in langs])[0]
            return f"Translate {LANGUAGES[lang]} to English: {rng.choice(sentences[lang])}"
        makers["translation"] = translate
    makers["qa"] = lambda _: rng.choice(FACT_QUESTIONS).format(**_slots(rng))
    cats = list(makers)
    out = []
    for i in range(count):
        cat = cats[i % len(cats)]
        out.append(TrainingPrompt(cat, makers[cat](articles[(i // len(cats)) % len(articles)] if articles else None)))
    return out


def all_foreign_sentences(langs: Iterable[str] = LANGUAGES) -> dict[str, list[str]]:
    return {lang: foreign_sentences(lang) for lang in langs}
