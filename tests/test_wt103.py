import pytest

from txl.data.tokenizer.wt103 import (
    detokenize,
    detokenize_numbers,
    normalize_punctuation,
    tokenize,
    tokenize_numbers,
)

# Expected tokens produced by Hugging Face's TransfoXLTokenizer pipeline (sacremoses
# MosesPunctNormalizer + MosesTokenizer(aggressive_dash_splits=True, escape=False) + tokenize_numbers),
# recorded once so that this test needs neither sacremoses nor a download.
GOLDEN = [
    (
        "The company, founded in 1998, earned $5,000,000 in 2003.",
        "The company , founded in 1998 , earned $ 5 @,@ 000 @,@ 000 in 2003 .",
    ),
    (
        "The well-known state-of-the-art model (Dai et al., 2019) works.",
        "The well @-@ known state @-@ of @-@ the @-@ art model ( Dai et al . , 2019 ) works .",
    ),
    (
        "It's John's car; they don't know, isn't it?",
        "It 's John 's car ; they don 't know , isn 't it ?",
    ),
    (
        '"Hello," she said. "How are you?"',
        '" Hello , " she said . " How are you ? "',
    ),
    (
        "Mr. Smith went to Washington, D.C. on Jan. 5.",
        "Mr. Smith went to Washington , D.C. on Jan. 5 .",
    ),
    (
        "Wait... what happened?!",
        "Wait ... what happened ? !",
    ),
    (
        "The 1990's were great; the '80s were better.",
        "The 1990 's were great ; the ' 80s were better .",
    ),
    (
        "Temperature was -5 degrees, not 5-10 degrees.",
        "Temperature was -5 degrees , not 5 @-@ 10 degrees .",
    ),
    (
        "The album sold 1,000,000 copies in the U.K.",
        "The album sold 1 @,@ 000 @,@ 000 copies in the U.K.",
    ),
    (
        "The team's 2–1 win — a surprise — came in 2010.",
        "The team 's 2 @-@ 1 win - a surprise - came in 2010 .",
    ),
    (
        "“Curly quotes” and ‘single’ ones…",
        "\" Curly quotes \" and ' single ' ones ...",
    ),
    (
        'He wrote: "Go home", and then left.',
        'He wrote : " Go home , " and then left .',
    ),
    (
        "See pp. 12-14, No. 5 and Art. 3 of the Treaty.",
        "See pp. 12 @-@ 14 , No. 5 and Art. 3 of the Treaty .",
    ),
    (
        "Dr. Who (born 1.1.1970) said: 'I'm fine, thanks.'",
        "Dr. Who ( born 1 @.@ 1 @.@ 1970 ) said : ' I 'm fine , thanks . '",
    ),
    (
        "E-mail me at foo@bar.com or visit http://x.org/a_b.",
        "E @-@ mail me at foo @ bar.com or visit http : / / x.org / a _ b .",
    ),
    (
        "The <unk> was found near <unk>, in the 19th century.",
        "The <unk> was found near <unk> , in the 19th century .",
    ),
]

# Sentences that come back unchanged after tokenize -> detokenize.
ROUND_TRIP = [
    "The company, founded in 1998, earned $5,000,000 in 2003.",
    "He was 1.80 m tall and weighed 75.5 kg.",
    "The well-known state-of-the-art model (Dai et al., 2019) works.",
    "It's John's car; they don't know, isn't it?",
    '"Hello," she said. "How are you?"',
    "Mr. Smith went to Washington, D.C. on Jan. 5.",
    "Wait... what happened?!",
    "About 45% of the 2,300 voters (i.e. most) agreed: yes.",
    "The 1990's were great; the '80s were better.",
    "She said 'no' and left.",
    "It was the Joneses' house, and the boys' toys were there.",
    "It cost £3.5 million [citation needed].",
    "In 1,234.56 meters there are 3.14 things.",
    "Über-cool café owners in São Paulo aren't amused.",
    "Version 2.0.1 was released on 2020-01-05.",
    "= = Gameplay = =",
]


@pytest.mark.parametrize(("text", "expected"), GOLDEN)
def test_tokenize_matches_hf_pipeline(text, expected):
    assert tokenize(text) == expected.split()


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(text):
    assert detokenize(tokenize(text)) == text


def test_detokenize_wikitext_line():
    line = (
        "Valkyria Chronicles III is a tactical role @-@ playing game , released in 2011 "
        "for $ 1 @,@ 000 ( 3 @.@ 5 % off ) . It 's the team 's \" best \" game ."
    )
    assert detokenize(line) == (
        "Valkyria Chronicles III is a tactical role-playing game, released in 2011 "
        "for $1,000 (3.5% off). It's the team's \"best\" game."
    )


def test_detokenize_eos_ends_lines_and_accepts_lists():
    assert detokenize(["a", ".", "<eos>", "b", "!", "<eos>"]) == "a.\nb!\n"
    assert detokenize("x <eos> y", eos="</s>") == "x <eos> y"


def test_special_tokens_are_kept():
    # What the Moses pipeline gives: the protected token reads as a word, so its hyphen becomes @-@.
    assert tokenize("an <unk>-like <eos> token") == ["an", "<unk>", "@-@", "like", "<eos>", "token"]
    assert tokenize("the <unk>'s dog") == ["the", "<unk>", "'s", "dog"]
    assert tokenize("<unk>", special_tokens=()) == ["<", "unk", ">"]


def test_normalize_punctuation():
    assert normalize_punctuation("“a” – ‘b’ … c—d") == "\"a\" - 'b' ... c - d"
    assert normalize_punctuation('say "yes", then') == 'say "yes," then'


NUMBER_CASES = [
    ["$", "5,000", "1.73", "m"],
    ["1,234,567.89", "and", "3.14159"],
    ["2,3", "x.5", "5.", ".5", "1..2", "U.S.", "a,b"],
    ["10,000-strong", "v1.2.3"],
]


@pytest.mark.oracle
@pytest.mark.parametrize("tokens", NUMBER_CASES)
def test_number_splitting_matches_hf_functions(tokens):
    hf = pytest.importorskip("transformers.models.deprecated.transfo_xl.tokenization_transfo_xl")
    ours = tokenize_numbers(tokens)
    assert ours == hf.tokenize_numbers(tokens)
    joined = " ".join(ours)
    assert detokenize_numbers(joined) == hf.detokenize_numbers(joined)


def test_number_splitting_examples():
    assert tokenize_numbers(["$", "5,000", "1.73", "m"]) == ["$", "5", "@,@", "000", "1", "@.@", "73", "m"]
    assert detokenize_numbers("$ 5 @,@ 000 1 @.@ 73 m") == "$ 5,000 1.73 m"


@pytest.mark.oracle
def test_against_live_sacremoses_if_installed():
    sm = pytest.importorskip("sacremoses")
    hf = pytest.importorskip("transformers.models.deprecated.transfo_xl.tokenization_transfo_xl")
    norm, moses, demoses = sm.MosesPunctNormalizer("en"), sm.MosesTokenizer("en"), sm.MosesDetokenizer("en")
    for text in ROUND_TRIP + [text for text, _ in GOLDEN]:
        toks = moses.tokenize(
            norm.normalize(text), aggressive_dash_splits=True, escape=False, protected_patterns=["<unk>"]
        )
        expected = hf.tokenize_numbers(toks)
        assert tokenize(text) == expected
        assert detokenize(expected) == hf.detokenize_numbers(demoses.detokenize(expected)).strip()


def test_rejects_non_text():
    with pytest.raises(TypeError, match="str"):
        tokenize(["already", "split"])
