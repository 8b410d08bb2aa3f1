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

import gzip
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
    makers = {}
    if articles:
        _add_reading(makers, rng, "article", lambda a: a[0], lambda a: a[1])
    _add_translation(makers, rng, sentences)
    makers["qa"] = lambda _: rng.choice(FACT_QUESTIONS).format(**_slots(rng))
    return _in_turn(makers, count, lambda i: articles[(i // len(makers)) % len(articles)] if articles else None)


def _add_reading(makers: dict, rng: random.Random, noun: str, text, question) -> None:
    """makers["summarization"] and makers["rag"] over material m: text(m) to summarize, or to
    answer question(m) from."""
    makers["summarization"] = lambda m: rng.choice(["Summarize: {t}", f"Summarize the following {noun}.\n\n{{t}}",
                                                    f"{{t}}\n\nSummarize the {noun} above in a few sentences."]
                                                   ).format(t=text(m))
    makers["rag"] = lambda m: rng.choice(["{t}\n{q}", "{t}\n\nAnswer using the text above: {q}"]
                                         ).format(t=text(m), q=question(m))


def _add_translation(makers: dict, rng: random.Random, sentences: dict[str, list[str]]) -> None:
    """makers["translation"]: "Translate <language> to English: <sentence>", the languages by
    LANGUAGE_WEIGHTS among those with sentences (none: no translation prompts)."""
    langs = [lang for lang in LANGUAGE_WEIGHTS if sentences.get(lang)]
    if langs:
        def translate(_):
            lang = rng.choices(langs, weights=[LANGUAGE_WEIGHTS[x] for x in langs])[0]
            return f"Translate {LANGUAGES[lang]} to English: {rng.choice(sentences[lang])}"
        makers["translation"] = translate


def _in_turn(makers: dict, count: int, material) -> list[TrainingPrompt]:
    """`count` prompts, the makers' categories in turn, the i-th made from material(i)."""
    cats = list(makers)
    return [TrainingPrompt(cats[i % len(cats)], makers[cats[i % len(cats)]](material(i)))
            for i in range(count if cats else 0)]


def all_foreign_sentences(langs: Iterable[str] = LANGUAGES) -> dict[str, list[str]]:
    return {lang: foreign_sentences(lang) for lang in langs}


# --- Passages: text people wrote, found on this machine -------------------------------------
# The articles above are the target's own prose; the evaluation's summaries, RAG passages and
# translations read text people wrote (rarer words, names, longer sentences), which the target
# copies from. The manual pages (/usr/share/man: English, and the German translations) are such
# text on every Debian-like machine; the prompts are built from them by `passage_prompts`.

_ROFF_LETTERS = {":a": "ä", ":o": "ö", ":u": "ü", ":A": "Ä", ":O": "Ö", ":U": "Ü", "ss": "ß"}
_ROFF_ESCAPES = [(re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""), (re.compile(r"\\s[+-]?\d+"), ""),
                 (re.compile(r"\\\*\((lq|rq)"), '"'), (re.compile(r"\\\((lq|rq|dq)"), '"'),
                 (re.compile(r"\\(?:\(|\[)(:[aouAOU]|ss)\]?"), lambda m: _ROFF_LETTERS[m.group(1)]),
                 (re.compile(r"\\\((em|en)"), "-"), (re.compile(r"\\\(aq"), "'"), (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),
                 (re.compile(r"\\[-]"), "-"), (re.compile(r"\\[&|^,/%:]"), ""), (re.compile(r"\\e"), ""),
                 (re.compile(r"\\ "), " ")]
_PARAGRAPH_BREAKS = re.compile(r"^[.'](PP|LP|P|SH|SS|TP|IP|HP|sp|br|RS|RE|nf|fi|EX|EE|TH|in|ti)\b")
_WORD = re.compile(r"[^\W\d_]{2,}")
_SENTENCE_END = re.compile(r"(?<=[a-zäöüß0-9)][.!?])\s+(?=[A-ZÄÖÜ])")


def _unescape(line: str) -> str:
    for pattern, repl in _ROFF_ESCAPES:
        line = pattern.sub(repl, line)
    return line


def roff_paragraphs(source: str) -> list[str]:
    """The prose paragraphs of a manual page's roff source: text lines joined up to the next
    paragraph macro or blank line, font and character escapes removed; macro lines, comments and
    no-fill blocks (examples, tables) dropped, so what is left is sentences people wrote."""
    paragraphs, lines, nofill = [], [], False

    def flush() -> None:
        text = " ".join(" ".join(lines).split())
        if text:
            paragraphs.append(text)
        lines.clear()

    for raw in source.splitlines():
        if raw.startswith(('.\\"', "'\\\"", '\\"')):  # comments
            continue
        if raw.startswith((".nf", ".EX", ".TS")):
            nofill = True
        if raw.startswith((".fi", ".EE", ".TE")):
            nofill = False
            flush()
            continue
        if nofill:
            continue
        if not raw.strip() or _PARAGRAPH_BREAKS.match(raw):
            flush()
            continue
        if raw.startswith((".", "'")):
            macro, _, rest = raw.partition(" ")
            if macro in (".B", ".I", ".BR", ".IR", ".RB", ".RI", ".BI", ".IB", ".SM"):
                lines.append(_unescape(rest.replace('"', "")))  # font macros hold text (their words, spaced)
            else:
                flush()
            continue
        lines.append(_unescape(raw))
    flush()
    return paragraphs


def is_prose(text: str, min_words: int) -> bool:
    """Mostly words, ending a sentence: not a list of options, a synopsis or a table row."""
    words = text.split()
    if len(words) < min_words or text[-1] not in ".!?":
        return False
    return sum(bool(_WORD.fullmatch(w.strip(".,;:()\"'!?"))) for w in words) >= 0.8 * len(words)


def man_pages(man_dir: Path, sections: str = "1578", per_family: int = 3) -> list[Path]:
    """The gzipped pages of the sections, sorted, at most `per_family` of the pages whose names
    share their part before the first '_' (one tool's thousands of generated subcommand pages,
    such as gcloud's, would be most of the text otherwise)."""
    pages, families = [], {}
    for p in sorted(p for s in sections for p in Path(man_dir).glob(f"man{s}/*.gz")):
        family = p.name.split("_")[0]
        families[family] = families.get(family, 0) + 1
        if families[family] <= per_family:
            pages.append(p)
    return pages


def man_passages(man_dir: Path = Path("/usr/share/man"), *, min_words: int = 25,
                 max_words: int = 220) -> list[tuple[str, str]]:
    """(page name, passage) over the manual pages under `man_dir` (a language's folder, e.g.
    /usr/share/man/de, for its translations): consecutive prose paragraphs of one page joined up to
    `max_words`, passages under `min_words` dropped; sorted by page."""
    out = []
    for page in man_pages(man_dir):
        try:
            source = gzip.decompress(page.read_bytes()).decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        name = page.name.split(".")[0]
        block: list[str] = []
        words = 0  # in block
        for para in (p for p in roff_paragraphs(source) if is_prose(p, 8)):
            n = len(para.split())
            if block and words + n > max_words:
                out.append((name, " ".join(block)))
                block, words = [], 0
            if n <= max_words:
                block.append(para)
                words += n
        if block:
            out.append((name, " ".join(block)))
    # a passage that starts inside a sentence (after an option's name, say) starts at its next one
    out = [(n, t if t[0].isupper() or t.split()[0] == n else (_SENTENCE_END.split(t, 1) + [""])[1])
           for n, t in out]
    return [(n, t) for n, t in out if len(t.split()) >= min_words]



def sentences(passages: Iterable[tuple[str, str]], min_chars: int = 40, max_chars: int = 240) -> list[str]:
    """The sentences of the passages that are prose of `min_chars`..`max_chars`, deduplicated, in order."""
    seen: dict[str, None] = {}
    for _, text in passages:
        for s in _SENTENCE_END.split(text):
            if min_chars <= len(s) <= max_chars and is_prose(s, 6):
                seen.setdefault(s, None)
    return list(seen)


PASSAGE_QUESTIONS = ["What does {name} do?", "What is {name} used for?", "According to the text, what does {name} do?",
                     "How is {name} used?", "What does the text say about {name}?", "Why would someone use {name}?"]


def passage_prompts(seed: int, passages: Sequence[tuple[str, str]], count: int,
                    foreign: dict[str, list[str]]) -> list[TrainingPrompt]:
    """Summarization, rag and translation prompts in turn over (name, passage) pairs and
    {language: sentences} (the evaluation's own forms: "Summarize: ...", a passage and a question,
    "Translate German to English: ..."); deterministic for a seed, a category without material skipped."""
    rng = random.Random(seed)
    order = list(range(len(passages)))
    rng.shuffle(order)
    makers = {}
    if passages:
        _add_reading(makers, rng, "text", lambda p: p[1], lambda p: rng.choice(PASSAGE_QUESTIONS).format(name=p[0]))
    _add_translation(makers, rng, foreign)
    return _in_turn(makers, count, lambda i: passages[order[i % len(order)]] if passages else None)
