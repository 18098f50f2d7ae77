"""Tests of prepare_data.py (CPU, a few seconds): python -m pytest -q test_data.py"""
import json
import os

import numpy as np
import pytest

import prepare_data
from prepare_data import HEADER, get_tokenizer, load_default_corpus, load_tokens, prepare

TEXT = "To be, or not to be: that is the question.\n\tCafé — ‘naïve’ 🎭 ends <|endoftext|> here\n"

# documents of the local corpora: ASCII, accents, emoji, CJK, blank lines, a literal special token
DOCUMENTS = [f"Document {i}: {TEXT * (i % 5 + 1)}{'世界' * i}\n\n{'x' * (i * 37 % 101)}" for i in range(40)]


def read_split_documents(folder, tokenizer):
    """The texts of the documents of train.bin and val.bin, decoded through doc_offsets."""
    tok = get_tokenizer(tokenizer)
    skip = 0 if tok.eot is None else 1
    texts = {}
    for split in ("train", "val"):
        tokens = load_tokens(folder / f"{split}.bin", tokenizer, tok.vocab_size)
        if tok.eot is not None:
            assert (tokens.tokens[tokens.doc_offsets] == tok.eot).all()  # each document begins with eot
        texts[split] = [tok.decode(tokens.document(i)[skip:]) for i in range(len(tokens.doc_offsets))]
    return texts


def assert_split_round_trip(folder, tokenizer, documents):
    texts = read_split_documents(folder, tokenizer)
    assert texts["train"] and texts["val"]
    assert sorted(texts["train"] + texts["val"]) == sorted(documents)


# ----------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("name, vocab_size, eot", [("bytes", 256, None), ("cl100k_base", 100277, 100257)])
def test_tokenizer_round_trip(name, vocab_size, eot):
    tok = get_tokenizer(name)
    assert (tok.name, tok.vocab_size, tok.eot) == (name, vocab_size, eot)
    ids = tok.encode(TEXT)
    assert all(0 <= i < vocab_size for i in ids) and eot not in ids  # a literal <|endoftext|> is plain text
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.array(ids, dtype=prepare_data.token_dtype(vocab_size))) == TEXT


def test_tokenizer_errors(monkeypatch):
    import tiktoken

    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        get_tokenizer("nope")

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="internet access.*cl100k_base"):
        prepare_data._load_tiktoken("gpt2")


def test_token_dtype():
    assert [prepare_data.token_dtype(v).itemsize for v in (256, 257, 65536, 65537, 200019)] == [1, 2, 2, 4, 4]


# ----------------------------------------------------------------------------- default corpus

def test_default_corpus_contents():
    works = load_default_corpus()
    titles = [work["title"] for work in works]
    assert len(works) == 49 and len(set(titles)) == 49
    assert len({work["text"] for work in works}) == 49
    assert sum(work["author"] == "Milton, John" for work in works) == 7
    assert not any("gutenberg" in work["text"].lower() or "\r" in work["text"] for work in works)
    assert "Actus primus" not in "".join(titles)  # no First Folio edition
    assert set(prepare_data.VALIDATION_WORKS) <= set(titles)
    lengths = {work["title"]: len(work["text"]) for work in works}
    longest_val = sorted(prepare_data.VALIDATION_WORKS, key=lengths.get)[-len(prepare_data.LONG_WORKS):]
    assert set(prepare_data.LONG_WORKS) == set(longest_val)


@pytest.fixture(scope="module")
def default_bytes(tmp_path_factory):
    return prepare(data_dir=tmp_path_factory.mktemp("data"), num_proc=2)


def test_prepare_default_bytes(default_bytes):
    assert default_bytes.name == "default_bytes"
    works = load_default_corpus()
    title_of = {work["text"]: work["title"] for work in works}
    tok = get_tokenizer("bytes")
    titles = {}
    for split in ("train", "val", "long"):
        tokens = load_tokens(default_bytes / f"{split}.bin", "bytes", 256)
        assert tokens.tokens.dtype == np.uint8 and isinstance(tokens.tokens, np.memmap)
        titles[split] = [title_of[tok.decode(tokens.document(i))] for i in range(len(tokens.doc_offsets))]
        assert len(tokens) == sum(len(w["text"].encode()) for w in works if w["title"] in titles[split])
    assert not set(titles["train"]) & set(titles["val"])
    assert sorted(titles["train"] + titles["val"]) == sorted(w["title"] for w in works)
    assert sorted(titles["val"]) == sorted(prepare_data.VALIDATION_WORKS)
    assert sorted(titles["long"]) == sorted(prepare_data.LONG_WORKS)
    meta = json.loads((default_bytes / "meta.json").read_text())
    train, val = meta["files"]["train.bin"]["tokens"], meta["files"]["val.bin"]["tokens"]
    assert train > 5_000_000 and 0.1 < val / (train + val) < 0.2
    assert not [path for path in default_bytes.iterdir() if "tmp" in path.name]


def test_prepare_is_idempotent_and_repairs(default_bytes, capsys):
    mtime = (default_bytes / "train.bin").stat().st_mtime_ns
    assert prepare(data_dir=default_bytes.parent) == default_bytes
    assert "already prepared" in capsys.readouterr().out
    assert (default_bytes / "train.bin").stat().st_mtime_ns == mtime
    with open(default_bytes / "long.bin", "r+b") as f:
        f.truncate(1000)
    prepare(data_dir=default_bytes.parent, num_proc=2)
    assert "wrote" in capsys.readouterr().out
    assert len(load_tokens(default_bytes / "long.bin").doc_offsets) == len(prepare_data.LONG_WORKS)


# ----------------------------------------------------------------------------- refusals

@pytest.fixture
def token_file(tmp_path):
    folder = tmp_path / "default_bytes"
    folder.mkdir()
    with prepare_data._TokenWriter(folder / "train.bin", get_tokenizer("bytes")) as writer:
        writer.add(np.frombuffer(b"hello", dtype=np.uint8))
        writer.add(np.frombuffer(b"world!", dtype=np.uint8))
    return folder / "train.bin"


def test_load_tokens_reads_header_offsets_and_tokens(token_file):
    tokens = load_tokens(token_file, "bytes", 256)
    assert (tokens.tokenizer, tokens.vocab_size, len(tokens)) == ("bytes", 256, 11)
    assert tokens.doc_offsets.tolist() == [0, 5]
    assert bytes(tokens.document(-1)) == b"world!" and bytes(tokens.tokens) == b"helloworld!"


RERUN = "python prepare_data.py --dataset default --tokenizer bytes"


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage, message", [
    (lambda p: os.truncate(p, p.stat().st_size - 1), "truncated"),
    (lambda p: os.truncate(p, 10), "truncated"),
    (lambda p: corrupt(p, 0, b"NOTTOKEN"), "bad magic"),
    (lambda p: corrupt(p, 8, (7).to_bytes(2, "little")), "format version 7"),
    (lambda p: corrupt(p, 10, (3).to_bytes(2, "little")), "corrupt"),
    (lambda p: corrupt(p, HEADER.size, (3).to_bytes(8, "little")), "invalid document offsets"),
    (lambda p: open(p, "ab").write(b"\0"), "corrupt"),
])
def test_load_tokens_refuses_damaged_files(token_file, damage, message):
    damage(token_file)
    with pytest.raises(ValueError, match=message) as error:
        load_tokens(token_file, "bytes", 256)
    assert RERUN in str(error.value)


def test_load_tokens_refuses_mismatch_and_missing(token_file):
    with pytest.raises(ValueError, match="not of the expected tokenizer 'cl100k_base'") as error:
        load_tokens(token_file, "cl100k_base")
    assert "--dataset default --tokenizer cl100k_base" in str(error.value)
    with pytest.raises(ValueError, match="vocabulary size 256, not the expected 512"):
        load_tokens(token_file, vocab_size=512)
    with pytest.raises(FileNotFoundError, match=RERUN):
        load_tokens(token_file.with_name("val.bin"), "bytes")


def test_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with prepare_data._TokenWriter(tmp_path / "train.bin", get_tokenizer("bytes")) as writer:
            writer.add(np.zeros(10, dtype=np.uint8))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- user corpora

def test_txt_directory_corpus(tmp_path):
    corpus = tmp_path / "texts"
    (corpus / "more").mkdir(parents=True)
    for i, text in enumerate(DOCUMENTS):
        (corpus / ("more" if i % 2 else "") / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    (corpus / "empty.txt").write_text("")  # skipped: no tokens
    (corpus / "notes.md").write_text("not a document")
    folder = prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=2)
    assert folder == tmp_path / "data" / "texts_bytes"
    assert_split_round_trip(folder, "bytes", DOCUMENTS)
    first = {name: (folder / name).read_bytes() for name in ("train.bin", "val.bin")}
    prepare(str(corpus), "bytes", tmp_path / "other", val_fraction=0.25, num_proc=1)  # split and files deterministic
    assert all((tmp_path / "other" / "texts_bytes" / name).read_bytes() == data for name, data in first.items())


def test_jsonl_corpus_cl100k(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": text}) + "\n" for i, text in enumerate(DOCUMENTS)))
    prepare_data.main(["--dataset", str(path), "--tokenizer", "cl100k_base", "--data_dir", str(tmp_path),
                       "--text_field", "content", "--val_fraction", "0.25", "--num_proc", "2"])
    out = capsys.readouterr().out
    assert "wrote" in out and "train.bin" in out and "val.bin" in out
    folder = tmp_path / "docs_cl100k_base"
    assert load_tokens(folder / "train.bin").tokens.dtype == np.uint32
    assert_split_round_trip(folder, "cl100k_base", DOCUMENTS)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["files"]["train.bin"]["documents"] + meta["files"]["val.bin"]["documents"] == len(DOCUMENTS)
    prepare(str(path), "cl100k_base", tmp_path, text_field="content", val_fraction=0.25, max_docs=10)
    assert sum(len(docs) for docs in read_split_documents(folder, "cl100k_base").values()) == 10


def test_corpus_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(ValueError, match="no field 'text'.*--text_field"):
        prepare(str(path), "bytes", tmp_path, num_proc=1)
    with pytest.raises(ValueError, match="no documents for val"):
        prepare(str(path), "bytes", tmp_path, text_field="content", val_fraction=1e-9, num_proc=1)
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        prepare(str(tmp_path / "missing"), "bytes", tmp_path)
    assert not list((tmp_path / "docs_bytes").iterdir())  # nothing half-written


def test_parquet_corpus(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    path = tmp_path / "docs.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": DOCUMENTS}), path, row_group_size=7)
    folder = prepare(str(path), "bytes", tmp_path, val_fraction=0.25, num_proc=2)
    assert_split_round_trip(folder, "bytes", DOCUMENTS)


def test_hf_dataset(tmp_path):
    pytest.importorskip("datasets")
    corpus = tmp_path / "hub_like"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    folder = prepare(f"hf:{corpus}", "bytes", tmp_path / "data", val_fraction=0.25, num_proc=2)  # a local folder
    assert folder.name.startswith("hf_") and folder.name.endswith("hub_like_bytes")
    assert_split_round_trip(folder, "bytes", DOCUMENTS)
