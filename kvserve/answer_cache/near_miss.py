"""The semantic cache's near-miss guard: two questions that embed close together but ask
different things. Mean-pooled sentence embeddings barely see the words that change the answer
("Is it safe / unsafe to mix bleach and ammonia?" 0.991, "17 times 23 / 24" 0.911, "string to
integer / integer to string" 0.993), so before a cached answer is served the two texts must
agree, word for word, on:

- numbers and arithmetic, in order: digits, number words ("twenty-four" = 24, but "one hour" =
  "an hour"), ordinals ("the second" = "2nd" = 2), fractions, operators ("times" = "x" = "*",
  "squared" = "to the power of 2"), and the unit right after a number ("60 mph");
- negation: the parity of negators ("not", "n't", "no", "never", "without") plus words whose
  negating prefix the other text lacks ("unsafe" / "safe"), so "not safe" = "unsafe"; and no
  two words on one root with contrary prefixes ("encrypt" / "decrypt", "import" / "export");
- contrary words from a fixed list of antonyms ("ascending" / "descending", "max" / "min");
- named entities (capitalized or mixed-case words, acronyms), each found in the other text;
- units of measure (the same set: "oz" = "ounce", "km/h" = "kmh");
- roles: two shared words whose order flips across the same relation ("X to Y" / "Y to X",
  "X faster than Y", "dogs chase cats") -- a shared word or the same relation word between
  them in both texts; a plain reorder ("a list in Python" / "a Python list") passes.

All literal, English, no model: ~0.1 ms a question pair, linear in length (~40 ms for two
1500-word prompts). What it cannot see are sibling words with no mark of contrast ("file" /
"folder", "boiling" / "freezing": left to the threshold), roots under 4 letters ("zip" /
"unzip") and role swaps without a relation word ("Who beat Brazil?" / "Who did Brazil beat?").
benchmarks/bench_semantic_guard.py measures both on tests/answer_cache/pairs_hard.py.
"""
from __future__ import annotations

import re
from itertools import combinations

_TOKEN = re.compile(r"\d+(?:[.,/]\d+)*(?:st|nd|rd|th)?|[A-Za-z]+(?:'[A-Za-z]+)?|[%+*/×^$€£-]")
_REWRITE = [(re.compile(p, re.I), r) for p, r in (
    (r"\bkm\s*/\s*h\b|\bkph\b", "kmh"), (r"\bm\s*/\s*s\b", "mps"), (r"\bcan't\b|\bcannot\b", "can not"),
    (r"\bwon't\b", "will not"), (r"n't\b", " not"), (r"°\s*c\b", " celsius"), (r"°\s*f\b", " fahrenheit"))]


def _singular(w: str) -> str:
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        return w[:-1]
    return w


STOPWORDS = frozenset("""a an the is are was were be been being am do does did doing have has had
i me my we our you your he she it its they them their this that these those there here what which
who whom whose when where why how can could should would will shall may might must of in on at
for with about as and or but if then so any some to into onto from by than per vs versus over under
please tell explain way ways get use using make""".split())
STOPWORDS |= {_singular(w) for w in STOPWORDS}      # "does" -> "doe", "was" -> "wa"
NEGATORS = frozenset("not no never none nothing nobody nowhere neither nor without".split())
RELATIONS = {"to": "to", "into": "to", "onto": "to", "toward": "to", "towards": "to", "from": "from",
             "than": "than", "vs": "vs", "versus": "vs", "over": "over", "under": "under",
             "above": "above", "below": "below", "before": "before", "after": "after",
             "against": "against", "per": "per", "by": "by"}
NEG_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "de")
PREFIXES = NEG_PREFIXES + ("en", "ex", "up", "down", "pre", "post", "over", "under", "anti", "mis")

_SMALL = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven "
                                      "twelve thirteen fourteen fifteen sixteen seventeen eighteen "
                                      "nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9}
_ORDINALS = {w: i for i, w in enumerate("zeroth first second third fourth fifth sixth seventh eighth "
                                         "ninth tenth eleventh twelfth".split())}
_OPERATORS = {"plus": "+", "+": "+", "add": "+", "added": "+", "sum": "+", "minus": "-",
              "subtract": "-", "subtracted": "-", "times": "*", "*": "*", "×": "*", "multiply": "*",
              "multiplied": "*", "product": "*", "divided": "/", "divide": "/", "/": "/",
              "quotient": "/", "power": "^", "^": "^", "squared": "^2", "cubed": "^3",
              "%": "%", "percent": "%", "mod": "mod", "modulo": "mod", "remainder": "mod"}

_UNIT_NAMES = {
    "millimeter": "mm millimetre", "centimeter": "cm centimetre", "meter": "metre", "kilometer":
    "km kilometre", "inch": "inches", "foot": "feet ft", "yard": "yd", "mile": "mi",
    "milligram": "mg", "gram": "g", "kilogram": "kg kilo", "ton": "tonne", "ounce": "oz",
    "pound": "lb lbs £ gbp", "stone": "", "milliliter": "ml millilitre", "liter": "litre l",
    "gallon": "gal", "quart": "", "pint": "", "cup": "", "tablespoon": "tbsp", "teaspoon": "tsp",
    "celsius": "centigrade", "fahrenheit": "", "kelvin": "", "millisecond": "ms",
    "second": "sec", "minute": "min", "hour": "hr", "day": "", "week": "", "month": "",
    "year": "", "mph": "", "kmh": "", "mps": "", "knot": "", "bit": "", "byte": "",
    "kilobyte": "kb", "megabyte": "mb", "gigabyte": "gb", "terabyte": "tb", "calorie": "kcal",
    "joule": "", "watt": "", "kilowatt": "kw", "kwh": "", "volt": "", "amp": "ampere",
    "acre": "", "hectare": "", "dollar": "$ usd", "euro": "€ eur", "yen": "", "yuan": "",
    "rupee": ""}
UNITS = {alias: name for name, aliases in _UNIT_NAMES.items() for alias in [name, *aliases.split()]}


def _unit(w: str) -> str | None:
    """The unit a word names ("kilometres" -> "kilometer"), or None."""
    return UNITS.get(w) or UNITS.get(_singular(w))


_CONTRARY = """max/min maximum/minimum largest/smallest biggest/smallest big/small large/small
highest/lowest high/low tallest/shortest longest/shortest long/short first/last ascending/descending
push/pull start/stop begin/end open/close add/remove add/delete add/drop insert/delete create/delete
show/hide input/output send/receive buy/sell above/below inside/outside left/right top/bottom
front/back hot/cold warm/cool heat/cool fast/slow faster/slower fastest/slowest early/late
earliest/latest old/new oldest/newest young/old best/worst better/worse good/bad positive/negative
true/false win/lose gain/lose rise/fall north/south east/west day/night male/female men/women
boy/girl login/logout light/dark light/heavy lighter/heavier wet/dry cheap/expensive
cheapest/dearest easy/hard easy/difficult strong/weak upper/lower uppercase/lowercase even/odd
more/less most/least accept/reject allow/deny include/exclude public/private global/local
client/server time/space sender/receiver boiling/freezing melting/boiling enter/exit""".split()
CONTRARY = frozenset(frozenset(_singular(w) for w in p.split("/")) for p in _CONTRARY)


class Parsed:
    """One query, tokenized: `words` lower-cased and singular, `numbers` the arithmetic in
    order, `entities` and `units` as sets, `negations` the negators counted."""

    def __init__(self, text: str):
        for pattern, repl in _REWRITE:
            text = pattern.sub(repl, text)
        self.words: list[str] = []                 # lower-cased, singular
        self.lower: list[str] = []                 # lower-cased
        self.entities: set[str] = set()
        end = 0                                     # where the previous token ended
        for m in _TOKEN.finditer(text):
            tok = m.group()
            start = end == 0 or any(c in ".?!:" for c in text[end:m.start()])
            end = m.end()
            lower = tok.lower().split("'")[0]
            word = lower if tok[1:] != tok[1:].lower() else _singular(lower)     # not "HTTPS"
            if (tok.isalpha() and tok != "I" and lower not in _SMALL and lower not in _ORDINALS
                    and (tok[1:] != tok[1:].lower() or (tok[0].isupper() and not start))):
                self.entities.add(word)                 # "NASA", "iPhone", "Paris" (not "What")
            self.words.append(word)
            self.lower.append(lower)
        self.numbers = _arithmetic(self.lower)
        self.units = {_unit(w) for i, w in enumerate(self.lower)
                      if _unit(w) and not (w == "second" and i and self.lower[i - 1] == "the")}
        self.negations = sum(w in NEGATORS for w in self.words)
        self.content = [w for w in self.words if w.isalpha() and w not in STOPWORDS and w not in NEGATORS]


def near_miss(cached: str, query: str) -> str | None:
    """Why `query` must not get `cached`'s answer ("number", "negation", "contrary", "entity",
    "unit", "order"), or None when the two agree on all of it."""
    a, b = Parsed(cached), Parsed(query)
    if a.numbers != b.numbers:
        return "number"
    only_a, only_b = set(a.content) - set(b.content), set(b.content) - set(a.content)
    flips, contrary = _affixes(only_a, only_b)
    if contrary:
        return "negation"
    if (a.negations + flips) % 2 != b.negations % 2:
        return "negation"
    if any(frozenset((x, y)) in CONTRARY for x in only_a for y in only_b):
        return "contrary"
    words_a, words_b = set(a.words), set(b.words)
    if any(e not in words_b for e in a.entities) or any(e not in words_a for e in b.entities):
        return "entity"
    if a.units and b.units and a.units != b.units:     # "What year ..." asks for no unit
        return "unit"
    if _swapped(a.words, b.words):
        return "order"
    return None


def _arithmetic(words: list[str]) -> list[str]:
    """The numbers and operators of a query in order: number words read as digits, "x" between
    numbers as "*", "^" joined to its exponent, a unit right after a number kept with it ("60
    mph"). Empty when the query has no number: "add" or "product" alone is no arithmetic."""
    out: list[str] = []
    value, phrase = None, []                            # a number-word phrase being read
    attach = False                                      # the last token was a number
    for i, w in enumerate(words + [""]):
        if w in _SMALL or w in _TENS or (w in _SCALES and value is not None):
            value = value * _SCALES[w] if w in _SCALES else (value or 0) + _SMALL.get(w, _TENS.get(w, 0))
            phrase.append(w)
            continue
        if value is not None and (w == "-" or (w == "and" and value >= 100)):
            continue                                    # "twenty-four", "one hundred and five"
        if value is not None:
            if phrase == ["one"] and w.isalpha() and w not in _OPERATORS:
                value = None                            # "one hour" is "an hour"
            else:
                out.append(str(value))
                value, attach = None, True
            phrase = []
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if w[:1].isdigit():
            out.append(re.sub(r"(?<=\d),(?=\d{3})", "", re.sub(r"^(\d+)(?:st|nd|rd|th)$", r"\1", w)))
            attach = True
            continue
        if attach and _unit(w):
            out[-1] += " " + _unit(w)
        elif w in _ORDINALS and (w != "second" or (i and words[i - 1] == "the")):
            out.append(str(_ORDINALS[w]))              # "the second" == "2nd" == "2"
        elif w in _OPERATORS or (w in ("x", "-") and attach and nxt[:1].isdigit()):
            out.append(_OPERATORS.get(w, "*" if w == "x" else "-"))
        attach = attach and w in ("degree", "degrees")  # "100 degrees Fahrenheit"
    if not any(c.isdigit() for tok in out for c in tok):
        return []
    joined: list[str] = []
    for tok in out:                                     # "to the power of 2" == "squared"
        if joined and joined[-1] == "^" and tok[:1].isdigit():
            joined[-1] = "^" + tok
        else:
            joined.append(tok)
    return joined


def _affixes(only_a: set[str], only_b: set[str]) -> tuple[int, bool]:
    """(words of A negated by a prefix whose root only B has, "A or B" has two words on one root
    with contrary prefixes): "unsafe" / "safe" is a negation, "encrypt" / "decrypt" a contrary."""
    flips, contrary = 0, False
    for x in only_a:
        for y in only_b:
            for p in ("",) + PREFIXES:
                root = x[len(p):]
                if not x.startswith(p) or len(root) < 4:
                    continue
                q = next((q for q in ("",) + PREFIXES if q != p and y == q + root), None)
                if q is None:
                    continue
                if p == "" and q in NEG_PREFIXES:
                    flips += 1                          # the other text's word is negated
                elif q == "" and p in NEG_PREFIXES:
                    flips += 1
                else:
                    contrary = True
    return flips, contrary


def _swapped(a: list[str], b: list[str]) -> bool:
    """Two words shared once by both texts whose order flips while the same relation word
    ("to", "than") or another shared word stands between them in both."""
    def places(ws):
        pos: dict[str, list[int]] = {}
        for i, w in enumerate(ws):
            pos.setdefault(w, []).append(i)
        return pos

    pa, pb = places(a), places(b)
    shared = sorted((pa[w][0], pb[w][0], w) for w in pa if w in pb and w.isalpha() and w not in STOPWORDS
                    and w not in NEGATORS and len(pa[w]) == len(pb[w]) == 1)    # in A's order
    later_min = [len(b)] * (len(shared) + 1)          # the first place in B of words later in A
    for n in range(len(shared) - 1, -1, -1):
        later_min[n] = min(later_min[n + 1], shared[n][1])
    words = {w for _, _, w in shared}
    for n, (ia, ib, x) in enumerate(shared):
        if later_min[n + 1] > ib:
            continue                                    # no word after x in A comes before it in B
        for ja, jb, y in shared[n + 1:]:
            if jb > ib:
                continue
            between_a, between_b = set(a[ia + 1:ja]), set(b[jb + 1:ib])
            if (between_a & between_b & words) - {x, y}:
                return True                             # a shared pivot: "dogs chase cats"
            relations_a = {RELATIONS[w] for w in between_a if w in RELATIONS}
            if relations_a & {RELATIONS[w] for w in between_b if w in RELATIONS}:
                return True                             # the same relation: "X to Y" / "Y to X"
    return False
