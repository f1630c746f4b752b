"""The stdlib corpus (the default job's): split by a seeded hash of each file's path, so train, valid and
test are the same kind of text; disjoint, stable, no split dominated by one directory."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from txl.data import REGISTRY, download_corpus, load_corpus
from txl.data.stdlib import (
    SPLIT_SHARES,
    build_stdlib_corpus,
    path_hash,
    select,
    split_of,
    stdlib_files,
    stdlib_root,
)


@pytest.fixture(scope="module")
def default_size(tmp_path_factory):
    """The default job's corpus (4,000,000 bytes), built once: (its directory, its metadata)."""
    entry = build_stdlib_corpus(tmp_path_factory.mktemp("stdlib"), max_bytes=4_000_000)
    return entry, json.loads((entry / "meta.json").read_text(encoding="utf-8"))


def test_split_is_a_seeded_hash_of_the_path():
    # sha256 of "seed:path": the same on every machine; a file's split does not depend on max_bytes.
    # Pinned values: the hash is of the path text only, so they hold on every machine.
    assert path_hash("xmlrpc/client.py", 0) == 10019786586686124193 and split_of("xmlrpc/client.py", 0) == "valid"
    assert [split_of(p, 0) for p in ("json/decoder.py", "argparse.py", "encodings/cp1252.py")] == ["train"] * 3
    assert {split_of(f"pkg/mod{i}.py", 0) for i in range(200)} == {"train", "valid", "test"}
    counts = Counter(split_of(f"pkg/mod{i}.py", 0) for i in range(10_000))
    assert 8_800 < counts["train"] < 9_200 and 400 < counts["valid"] < 600 and 400 < counts["test"] < 600
    assert [split_of(f"m{i}.py", 0) for i in range(50)] != [split_of(f"m{i}.py", 1) for i in range(50)]


def test_splits_are_disjoint_sized_and_stable(default_size, tmp_path):
    entry, meta = default_size
    files = meta["files"]
    assert set(files["train"]).isdisjoint(files["valid"]) and set(files["train"]).isdisjoint(files["test"])
    assert set(files["valid"]).isdisjoint(files["test"])
    for split, share in SPLIT_SHARES:
        assert all(split_of(rel, 0) == split for rel in files[split])
        size = (entry / f"{split}.txt").stat().st_size
        assert size == meta["bytes"][split] and 0.99 * share * 40_000 <= size <= share * 40_000
    again = build_stdlib_corpus(tmp_path, max_bytes=4_000_000)  # a fresh build: byte for byte the same
    for split, _ in SPLIT_SHARES:
        assert (again / f"{split}.txt").read_bytes() == (entry / f"{split}.txt").read_bytes()


def test_no_split_is_dominated_by_one_directory(default_size):
    """Before, valid and test were the tail of a sorted walk: encodings/ character tables only."""
    entry, meta = default_size
    root = stdlib_root()
    for split, rels in meta["files"].items():
        by_dir: Counter[str] = Counter()
        for rel in rels:
            by_dir[rel.rsplit("/", 1)[0] if "/" in rel else "."] += (root / rel).stat().st_size
        top, top_bytes = by_dir.most_common(1)[0]
        assert len(rels) >= 10 and top_bytes / sum(by_dir.values()) < 0.5, (split, top, by_dir.most_common(3))


def test_small_sizes_keep_three_nonempty_splits_of_whole_lines():
    chosen = select(stdlib_files(stdlib_root()), 30_000, 0)
    for split, share in SPLIT_SHARES:
        data = b"".join(d for _, d in chosen[split])
        assert 0 < len(data) <= 300 * share and data.endswith(b"\n")
        data.decode("utf-8")


def test_stdlib_is_a_registry_entry_loaded_like_any_corpus(tmp_path):
    assert REGISTRY["stdlib"].generated == "stdlib" and REGISTRY["stdlib"].level == "byte"
    corpus = load_corpus("stdlib", cache_dir=tmp_path / "tokens", max_bytes=100_000)
    assert corpus.metric == "bpc" and corpus.vocab_size == 256
    # A given cache_dir holds everything: the token cache and the generated text (never written beside it).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]
    assert len(list((tmp_path / "tokens" / "stdlib").iterdir())) == 1
    texts = build_stdlib_corpus(tmp_path / "tokens" / "stdlib", max_bytes=100_000)  # found, not rebuilt
    assert [len(corpus.split(s)) for s in ("train", "valid", "test")] == \
        [(texts / f"{s}.txt").stat().st_size for s in ("train", "valid", "test")]
    assert Path(corpus.path).parent == tmp_path / "tokens"
    with pytest.raises(ValueError, match="nothing to download"):
        download_corpus("stdlib", tmp_path / "d")
