"""WikiText-103 tokenisation conventions, as used by the pretrained ``transfo-xl-wt103`` model.

WikiText-103 is word-level text whose tokens are separated by single spaces:

* punctuation is split off words: ``works .``, ``( Dai et al . , 2019 )``, ``45 %``;
* English clitics are split before the apostrophe: ``It 's``, ``don 't``, ``1990 's``;
* a hyphen between two word characters becomes the token ``@-@``: ``state @-@ of @-@ the @-@ art``;
* a comma or a dot between two digits becomes ``@,@`` / ``@.@``: ``5 @,@ 000``, ``3 @.@ 5``;
* abbreviations keep their dot: ``U.S.``, ``Mr.``, ``i.e.``.

Hugging Face's ``TransfoXLTokenizer`` (transformers 4.37, ``moses_pipeline``) reproduces this with the
Moses punctuation normaliser and tokenizer from ``sacremoses`` (English, ``aggressive_dash_splits=True``,
``escape=False``, special tokens protected) followed by ``tokenize_numbers``; and undoes it with the
Moses detokenizer followed by ``detokenize_numbers``. This module is a small, dependency-free,
rule-based re-implementation of those rules (our own code, not a port of every Moses rule): it agrees
with that pipeline on ordinary English text. Known simplifications: only the common part of the
punctuation normaliser is applied (typographic quotes, dashes, ellipsis, no-break spaces), the
non-breaking prefix list is a short English one, and there is no CJK/French/Czech handling.

One normalisation kept for fidelity changes the text: as in Moses for English, a closing double quote
followed by ``,`` or ``.`` is moved after them (``"home", and`` becomes ``home , "`` then ``home,"``).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

__all__ = [
    "Moses",
    "SPECIAL_TOKENS",
    "detokenize",
    "detokenize_numbers",
    "normalize_punctuation",
    "tokenize",
    "tokenize_numbers",
]

SPECIAL_TOKENS = ("<unk>", "<eos>", "<formula>")
"""Tokens passed through untouched (the pretrained tokenizer's special tokens)."""

# Character classes. Python's \w is letters, digits and underscore; Moses' IsAlnum has no underscore.
_ALPHA = r"[^\W\d_]"
_NOT_ALPHA = r"[\W\d_]"
_ALNUM = r"[^\W_]"

_NORMALIZE = [
    ("\r", ""),
    ("\u00a0", " "),  # no-break space
    ("„", '"'),
    ("“", '"'),
    ("”", '"'),
    ("«", '"'),
    ("»", '"'),
    ("–", "-"),  # en dash
    ("—", " - "),  # em dash
    ("´", "'"),
    ("‘", "'"),
    ("‚", "'"),
    ("’", "'"),
    ("''", '"'),
    ("…", "..."),
]

# Abbreviations whose final dot is not split off (besides single capital letters).
_NONBREAKING = frozenset(
    "Adj Adm Adv Asst Bart Bldg Brig Bros Capt Cmdr Col Comdr Con Corp Cpl DR Dr Drs Ens Gen Gov Hon Hr "
    "Hosp Insp Lt MM MR MRS MS Maj Messrs Mlle Mme Mr Mrs Ms Msgr Op Ord Pfc Ph Prof Pvt Rep Reps Res Rev "
    "Rt Sen Sens Sfc Sgt Sr St Supt Surg v vs i.e rev e.g "
    "Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec".split()
) | frozenset(chr(c) for c in range(ord("A"), ord("Z") + 1))
# Abbreviations that keep their dot only before a number ("No. 5", "pp. 12").
_NUMERIC_ONLY = frozenset("No Nos Art Nr pp".split())

_NUMBER_SEPARATOR = re.compile(r"(?<=\d)[,.](?=\d)")
_MULTIDOT = re.compile(r"\.{2,}")
_MULTIDOT_MARK = re.compile(r"TXLDOT([A-Z]+)TXLMULTI")
_SPECIAL_MARK = re.compile(r"TXLSPECIAL([A-Z]+)TXLEND")

_TOKEN_RULES = [
    # Pad every character that is not alphanumeric, space or one of . ' ` , - (those need context).
    (re.compile(r"([^\w\s.'`,-]|_)"), r" \1 "),
    # A hyphen between word characters becomes its own token @-@ ("aggressive dash splits").
    (re.compile(rf"({_ALNUM})-(?={_ALNUM})"), r"\1 @-@ "),
]
_COMMA_RULES = [
    (re.compile(r"(\D),"), r"\1 , "),
    (re.compile(r",(\D)"), r" , \1"),
    (re.compile(r"(\d),$"), r"\1 , "),
]
_APOSTROPHE_RULES = [
    (re.compile(rf"({_NOT_ALPHA})'({_NOT_ALPHA})"), r"\1 ' \2"),
    (re.compile(rf"([\W_])'({_ALPHA})"), r"\1 ' \2"),
    (re.compile(rf"({_ALPHA})'({_NOT_ALPHA})"), r"\1 ' \2"),
    (re.compile(rf"({_ALPHA})'({_ALPHA})"), r"\1 '\2"),  # clitic: John's -> John 's
    (re.compile(r"(\d)'(s)"), r"\1 '\2"),  # 1990's -> 1990 's
]


def normalize_punctuation(text: str) -> str:
    """Map typographic punctuation to the ASCII forms WikiText uses (curly quotes, dashes, ellipsis)."""
    for old, new in _NORMALIZE:
        text = text.replace(old, new)
    # English convention kept by the Moses normaliser: a quote before , or . goes after them.
    return re.sub(r'"([,.]+)', r'\1"', text)


def tokenize_numbers(tokens: Iterable[str]) -> list[str]:
    """Split ``,`` and ``.`` between digits into ``@,@`` / ``@.@`` tokens: ``5,000`` -> ``5 @,@ 000``."""
    out: list[str] = []
    for token in tokens:
        out.extend(_NUMBER_SEPARATOR.sub(r" @\g<0>@ ", token).split())
    return out


def detokenize_numbers(text: str) -> str:
    """Inverse of :func:`tokenize_numbers` on a space-joined string: ``5 @,@ 000`` -> ``5,000``."""
    return text.replace(" @,@ ", ",").replace(" @.@ ", ".")


def _split_final_dots(text: str) -> str:
    """Split a word-final ``.`` off unless the word is an abbreviation (Moses' non-breaking prefixes)."""
    tokens = text.split()
    for i, token in enumerate(tokens):
        if len(token) < 2 or not token.endswith("."):
            continue
        prefix = token[:-1]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if (
            ("." in prefix and re.search(_ALPHA, prefix))  # U.S. / e.g.
            or (prefix in _NONBREAKING and prefix not in _NUMERIC_ONLY)
            or (nxt and nxt[0].islower())  # the sentence goes on: not a full stop
            or (prefix in _NUMERIC_ONLY and nxt[:1].isdigit())
        ):
            continue
        tokens[i] = prefix + " ."
    return " ".join(tokens)


def _letters(i: int) -> str:
    """0 -> 'A', 25 -> 'Z', 26 -> 'BA': a digit-free index for placeholders."""
    s = ""
    while True:
        s = chr(ord("A") + i % 26) + s
        i //= 26
        if i == 0:
            return s


def tokenize(text: str, *, special_tokens: Sequence[str] = SPECIAL_TOKENS) -> list[str]:
    """Tokenise raw English text into WikiText-103 tokens.

    >>> tokenize("The state-of-the-art model cost $5,000 (i.e. 1.5 times more).")
    ['The', 'state', '@-@', 'of', '@-@', 'the', '@-@', 'art', 'model', 'cost', '$', '5', '@,@', '000', \
'(', 'i.e.', '1', '@.@', '5', 'times', 'more', ')', '.']

    Line breaks are treated as spaces; tokenise line by line and append ``<eos>`` to keep them.
    Occurrences of ``special_tokens`` (``<unk>``, ``<eos>``, ``<formula>``) are kept as single tokens.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    text = normalize_punctuation(text)
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"[\x00-\x1f]", "", text)

    protected: list[str] = []
    if special_tokens:
        pattern = re.compile("|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True)))

        def protect(m: re.Match[str]) -> str:
            protected.append(m.group(0))
            return f"TXLSPECIAL{_letters(len(protected) - 1)}TXLEND"

        text = pattern.sub(protect, text)
    text = text.strip()

    for regex, repl in _TOKEN_RULES:
        text = regex.sub(repl, text)
    # Keep runs of dots ("...") together as one token.
    text = _MULTIDOT.sub(lambda m: f" TXLDOT{_letters(len(m.group(0)))}TXLMULTI ", text)
    for regex, repl in _COMMA_RULES + _APOSTROPHE_RULES:
        text = regex.sub(repl, text)
    text = _split_final_dots(text)
    text = re.sub(r"\.' ?$", " . ' ", text)  # sentence-final .'

    text = _MULTIDOT_MARK.sub(lambda m: "." * _index(m.group(1)), text)
    if protected:
        text = _SPECIAL_MARK.sub(lambda m: protected[_index(m.group(1))], text)
    return tokenize_numbers(text.split())


def _index(letters: str) -> int:
    i = 0
    for ch in letters:
        i = i * 26 + ord(ch) - ord("A")
    return i


_LEFT_ATTACH = re.compile(r"^[,.?!:;\\%}\])]+$")  # no space before these
_CONTRACTION = re.compile(rf"^'{_ALPHA}")  # 's 't 're ...
_QUOTE = re.compile(r"^['\"`]+$")


def _right_attach(token: str) -> bool:
    """Currency symbols and opening brackets: no space after them."""
    return all(unicodedata.category(ch) == "Sc" or ch in "([{¿¡" for ch in token)


def _detokenize_line(tokens: list[str]) -> str:
    text = " " + " ".join(tokens) + " "
    text = text.replace(" @-@ ", "-")
    text = detokenize_numbers(text)
    tokens = text.split()
    out, space = "", " "
    open_quotes: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if _right_attach(token):
            out += space + token
            space = ""
        elif _LEFT_ATTACH.match(token):
            out += token
            space = " "
        elif i > 0 and _CONTRACTION.match(token):
            out += token
            space = " "
        elif _QUOTE.match(token):
            count = open_quotes.get(token, 0)
            if count % 2 == 1:  # closing quote: attach to the previous word
                out += token
                space = " "
                open_quotes[token] = count + 1
            elif token == "'" and i > 0 and tokens[i - 1].endswith("s"):
                out += token  # possessive of a plural: "the Joneses' house"
                space = " "
            else:  # opening quote: attach to the next word
                out += space + token
                space = ""
                open_quotes[token] = count + 1
        else:
            out += space + token
            space = " "
    return re.sub(" {2,}", " ", out).strip()


def _lines(tokens: str | Sequence[str], eos: str) -> list[list[str]]:
    """Tokens (a list, or one whitespace-separated string) cut into lines at each ``eos``."""
    if isinstance(tokens, str):
        tokens = tokens.split()
    lines: list[list[str]] = [[]]
    for token in tokens:
        if token == eos:
            lines.append([])
        else:
            lines[-1].append(token)
    return lines


def detokenize(tokens: str | Sequence[str], *, eos: str = "<eos>") -> str:
    """Turn WikiText-103 tokens (a list, or one space-separated string) back into readable text.

    Undoes ``@-@``, ``@,@`` and ``@.@``, removes the spaces before punctuation and clitics and
    inside brackets and quotes. Each ``eos`` token ends a line (``"\\n"``).

    >>> detokenize("It 's 5 @,@ 000 state @-@ of @-@ the @-@ art ( new ) models .")
    "It's 5,000 state-of-the-art (new) models."
    """
    return "\n".join(_detokenize_line(line) for line in _lines(tokens, eos))


class Moses:
    """The same conventions through ``sacremoses`` (``pip install txl[moses]``), as Hugging Face applies them.

    ``TransfoXLTokenizer.moses_pipeline`` of transformers 4.37: the English punctuation normaliser, the
    Moses tokenizer (``aggressive_dash_splits=True``, ``escape=False``, special tokens protected), then
    :func:`tokenize_numbers`; :meth:`detokenize` is the Moses detokenizer then :func:`detokenize_numbers`.
    The rule-based :func:`tokenize` above is the dependency-free default; this is the reference it follows.
    """

    def __init__(self, *, special_tokens: Sequence[str] = SPECIAL_TOKENS) -> None:
        try:
            import sacremoses
        except ImportError:
            raise ImportError("the sacremoses backend of the WikiText-103 rules needs the sacremoses package: "
                              "pip install 'txl[moses]', or use wt103_backend='builtin'") from None
        self.special_tokens = list(special_tokens)
        self._normalizer = sacremoses.MosesPunctNormalizer("en")
        self._tokenizer = sacremoses.MosesTokenizer("en")
        self._detokenizer = sacremoses.MosesDetokenizer("en")

    def tokenize(self, text: str) -> list[str]:
        text = self._normalizer.normalize(text.strip())
        tokens = self._tokenizer.tokenize(text, aggressive_dash_splits=True, return_str=False, escape=False,
                                          protected_patterns=[re.escape(s) for s in self.special_tokens])
        return tokenize_numbers(tokens)

    def detokenize(self, tokens: str | Sequence[str], *, eos: str = "<eos>") -> str:
        return "\n".join(detokenize_numbers(self._detokenizer.detokenize(line)).strip()
                         for line in _lines(tokens, eos))
