"""prepare_data.py: tokenizers, the default corpus, token files and their refusals, user corpora, hf datasets."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import prepare_data
from conftest import DOCUMENTS, REPO, TEXT, corrupt
from prepare_data import HEADER, get_tokenizer, load_default_corpus, load_tokens, prepare


# ============================================================================= prepare_data.py


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


def jsonl_corpus(path):
    """DOCUMENTS as a .jsonl corpus at path, one {"text": ...} record a line -> path."""
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    return path


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


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_prepare_is_idempotent_and_repairs(default_bytes, capsys):
    """A token file that is cut short or changed is named as it is rebuilt."""
    mtime = (default_bytes / "train.bin").stat().st_mtime_ns
    assert prepare(data_dir=default_bytes.parent) == default_bytes
    assert "already prepared" in capsys.readouterr().out
    assert (default_bytes / "train.bin").stat().st_mtime_ns == mtime
    with open(default_bytes / "long.bin", "r+b") as f:
        f.truncate(1000)
    prepare(data_dir=default_bytes.parent, num_proc=2)
    out, err = capsys.readouterr()
    assert "wrote" in out
    assert re.search(r"default_bytes/long.bin is truncated \(1000 bytes, its header says [0-9]+\): rebuilding it from "
                     r"the embedded corpus\n", err)
    assert len(load_tokens(default_bytes / "long.bin").doc_offsets) == len(prepare_data.LONG_WORKS)
    flip_byte(default_bytes / "val.bin", 5000)  # changed in place: the same size, caught by the checksum
    prepare(data_dir=default_bytes.parent, num_proc=2)
    out, err = capsys.readouterr()
    assert "wrote" in out
    assert (f"{default_bytes / 'val.bin'} is corrupt (its contents do not match the checksum in its header: the file "
            "was changed or damaged after prepare_data.py wrote it): rebuilding it from the embedded corpus\n") in err
    load_tokens(default_bytes / "val.bin", verify=True)


def test_the_default_corpus_notes_the_arguments_it_ignores(default_bytes, capsys):
    prepare_data.main(["--data_dir", str(default_bytes.parent), "--val_fraction", "0.1", "--max_docs", "5",
                       "--text_field", "text"])  # the default --text_field: no note
    out, err = capsys.readouterr()
    assert "already prepared" in out
    assert err == ("note: --val_fraction, --max_docs do not apply to the default corpus (a fixed set of works, split "
                   "by work): ignored\n")


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


def test_checksum_catches_changes_of_the_same_size(token_file):
    size, original = token_file.stat().st_size, token_file.read_bytes()
    for offset, data in ((size - 1, b"?"), (HEADER.size + 8, (4).to_bytes(8, "little"))):  # a token; offset 5 -> 4
        corrupt(token_file, offset, data)
        assert token_file.stat().st_size == size and len(load_tokens(token_file, "bytes", 256)) == 11  # unchecked
        with pytest.raises(ValueError, match="do not match the checksum in its header") as error:
            load_tokens(token_file, "bytes", 256, verify=True)
        assert RERUN in str(error.value)
        token_file.write_bytes(original)
    assert bytes(load_tokens(token_file, "bytes", 256, verify=True).tokens) == b"helloworld!"


def test_token_files_of_format_1_are_refused_with_the_rebuild_command(token_file):
    import struct

    magic, _, *fields, checksum = HEADER.unpack_from(token_file.read_bytes())
    version_1 = struct.pack("<8sHHIQQ64s", magic, 1, *fields)  # the header without the checksum
    token_file.write_bytes(version_1 + token_file.read_bytes()[HEADER.size:])
    with pytest.raises(ValueError, match=r"format version 1, this code reads version 2 \(it was written by an older "
                                         r"prepare_data.py\)") as error:
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


@pytest.mark.parametrize("args, message", [
    (["--val_fraction", "1.5"],  # refused for the default corpus too, which ignores it
     "--val_fraction 1.5 is out of range: give a fraction of the documents between 0 and 1 (exclusive), e.g. 0.01"),
    (["--dataset", "corpus", "--val_fraction", "0"], "--val_fraction 0.0 is out of range"),
    (["--dataset", "corpus", "--max_docs", "0"],
     "--max_docs 0 is out of range: give at least 1 (or leave it out: every document)"),
    (["--num_proc", "-1"], "--num_proc -1 is out of range: give at least 1 (or leave it out: all CPUs)"),
    (["--data_dir", "notes.txt"], "notes.txt is a file, not a folder, so notes.txt/default_bytes cannot be written: "
                                  "move it away or pass another --data_dir"),
    (["--dataset", "nowhere"], "no corpus at nowhere: pass --dataset default, hf:NAME, or a .txt/.jsonl/.parquet"),
    (["--dataset", ""], "--dataset is empty: pass --dataset default, hf:NAME, or a .txt/.jsonl/.parquet"),
    (["--dataset", "corpus", "--max_docs", "9" * 20], "--max_docs 99999999999999999999 is out of range: give at most"),
])
def test_bad_arguments_get_one_line_before_anything_is_written(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a folder")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(TEXT)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit:
        prepare_data.main(["--data_dir", "data", *args])
    assert exit.value.code.startswith(f"error: {message}") and "\n" not in exit.value.code
    assert sorted(tmp_path.rglob("*")) == before


def test_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with prepare_data._TokenWriter(tmp_path / "train.bin", get_tokenizer("bytes")) as writer:
            writer.add(np.zeros(10, dtype=np.uint8))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


# python -c SLOW_WORKERS prepare_data.py ARGS: the script, its workers slowed by 10 ms a document (in _split_key's hash)
SLOW_WORKERS = """import hashlib, runpy, sys, time
blake2b = hashlib.blake2b
hashlib.blake2b = lambda *args, **kwargs: time.sleep(0.01) or blake2b(*args, **kwargs)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")"""


@pytest.mark.parametrize("name, to_group, code, line", [
    ("SIGINT", True, 130, "interrupted"),  # Ctrl-C in a terminal: the script and its workers
    ("SIGTERM", False, 143, "terminated"),  # kill PID: the script alone (its workers used to die of broken pipes)
])
def test_a_signal_while_tokenizing_is_one_line_and_leaves_nothing(tmp_path, name, to_group, code, line):
    corpus = tmp_path / "big.jsonl"  # 1,000 documents of 10,000 bytes: 10 batches of a second each, slowed
    corpus.write_text("".join(json.dumps({"text": f"{i} " + "x" * 10_000}) + "\n" for i in range(1000)))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WORKERS, "prepare_data.py", "--dataset", str(corpus),
                             "--data_dir", str(tmp_path / "data"), "--num_proc", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not any(path.stat().st_size for path in tmp_path.glob("data/big_bytes/*.tokens.tmp")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.02)  # until a batch is written: the workers are busy with the next ones
        os.killpg(proc.pid, getattr(signal, name)) if to_group else proc.send_signal(getattr(signal, name))
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert (proc.returncode, err) == (code, f"{line}\n")
    assert list((tmp_path / "data").iterdir()) == []  # no staging file, no token file, no folder of this run


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


def test_lone_txt_file_is_cut_into_documents(tmp_path):
    lines = [f"line {i}: to be, or not to be 🎭\n" for i in range(3000)]
    (tmp_path / "input.txt").write_text("".join(lines), encoding="utf-8")
    folder = prepare(str(tmp_path / "input.txt"), "bytes", tmp_path / "data", val_fraction=0.1, num_proc=1)
    train_docs, val_docs = (load_tokens(folder / name) for name in ("train.bin", "val.bin"))
    assert len(train_docs.doc_offsets) + len(val_docs.doc_offsets) == 3000 // prepare_data.TXT_PIECE
    assert len(val_docs) > 0 and len(train_docs) + len(val_docs) == len("".join(lines).encode("utf-8"))


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


def test_a_damaged_token_file_is_rebuilt_from_its_corpus(tmp_path, capsys):
    corpus = jsonl_corpus(tmp_path / "docs.jsonl")
    folder = prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=1)
    flip_byte(folder / "train.bin", (folder / "train.bin").stat().st_size - 1)
    prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=1)
    assert (f"{folder / 'train.bin'} is corrupt (its contents do not match the checksum in its header: the file was "
            f"changed or damaged after prepare_data.py wrote it): rebuilding it from {corpus.resolve()}\n"
            ) in capsys.readouterr().err
    load_tokens(folder / "train.bin", verify=True)
    assert_split_round_trip(folder, "bytes", DOCUMENTS)


def disk_full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


def full_disk_exit(corpus, data_dir, val_fraction):
    """prepare_data.py on corpus into data_dir at val_fraction, which must exit -> its exit message."""
    with pytest.raises(SystemExit) as exit:
        prepare_data.main(["--dataset", str(corpus), "--data_dir", str(data_dir), "--val_fraction", val_fraction,
                           "--num_proc", "1"])
    return exit.value.code


def full_disk(folder, kept):
    """The regex of the full-disk message for folder: the earlier files kept (a rebuild), or nothing written."""
    outcome = "the earlier files are unchanged" if kept else "nothing was written"
    return (r"error: could not write the token files: the disk is full \([0-9,.]+ MB free in "
            rf"{re.escape(str(folder))}\); {outcome}: free some space there or pass another --data_dir, and run again")


class FullStagingFile:
    """A _TokenWriter's staging file on a full disk: writes fail, and so does the flush on closing."""
    write = disk_full

    def __init__(self, file):
        self.file = file

    def close(self):
        self.file.close()
        disk_full()

    @staticmethod
    def enter(writer):
        writer.file = FullStagingFile(open(writer.staging, "wb"))
        return writer


@pytest.mark.parametrize("where", ["staging file", "token file"])
def test_a_full_disk_leaves_nothing_and_says_so(tmp_path, monkeypatch, where):
    corpus = jsonl_corpus(tmp_path / "docs.jsonl")
    if where == "staging file":
        monkeypatch.setattr(prepare_data._TokenWriter, "__enter__", FullStagingFile.enter)
    else:  # the header and offsets are in, the tokens do not fit
        monkeypatch.setattr(prepare_data.shutil, "copyfileobj", lambda source, destination, length: disk_full())
    assert re.fullmatch(full_disk(tmp_path / "data" / "docs_bytes", kept=False),
                        full_disk_exit(corpus, tmp_path / "data", "0.25"))
    assert os.listdir(tmp_path / "data") == []  # no token file, temporary file or empty folder


@pytest.mark.parametrize("where", ["token file", "meta.json"])
def test_a_failed_rebuild_keeps_the_earlier_files(tmp_path, monkeypatch, where):
    """A rebuild (another --val_fraction) that fails at its last token file or at meta.json: the folder keeps the
    earlier train.bin, val.bin and meta.json, all of them, and nothing else; the message names the fix."""
    corpus = jsonl_corpus(tmp_path / "docs.jsonl")
    folder = prepare(str(corpus), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=1)
    earlier = {path.name: path.read_bytes() for path in folder.iterdir()}
    if where == "token file":  # the first of the two fits, the second does not
        copy, copied = prepare_data.shutil.copyfileobj, []
        monkeypatch.setattr(prepare_data.shutil, "copyfileobj", lambda source, destination, length: copied.append(
            1) or (copy(source, destination, length) if len(copied) == 1 else disk_full()))
    else:  # its first bytes go in
        monkeypatch.setattr(prepare_data.Path, "write_text", lambda path, text: open(path, "w").write(text[:9]) and
                            disk_full())
    assert re.fullmatch(full_disk(folder, kept=True), full_disk_exit(corpus, tmp_path / "data", "0.5"))
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == earlier


def small_corpus(folder, n):
    """n .txt documents in folder -> folder, as a str (of 60, none is drawn at --val_fraction 0.01, 3 at 0.083)."""
    folder.mkdir()
    for i in range(n):
        (folder / f"{i:02d}.txt").write_text(f"text {i}: " + TEXT * (i % 3 + 1), encoding="utf-8")
    return str(folder)


def test_more_processes_than_cpus_are_capped_with_a_note(tmp_path, monkeypatch, capsys):
    pools = []
    pool = prepare_data.multiprocessing.Pool
    monkeypatch.setattr(prepare_data.multiprocessing, "Pool", lambda n, **kw: pools.append(n) or pool(n, **kw))
    prepare(small_corpus(tmp_path / "texts", 20), "bytes", tmp_path / "data", val_fraction=0.25, num_proc=1000)
    assert pools == [os.cpu_count()]
    assert f"note: --num_proc 1000 is more than the {os.cpu_count()} CPUs: using {os.cpu_count()}\n" in (
        capsys.readouterr().err)


def test_hf_settings_with_a_local_corpus_are_noted_and_ignored(tmp_path, capsys):
    corpus = small_corpus(tmp_path / "texts", 20)
    folder = prepare(corpus, "bytes", tmp_path / "data", val_fraction=0.25, hf_config="foo", hf_split="test")
    assert capsys.readouterr().err.startswith(
        "note: --hf_config, --hf_split apply to hf: datasets only, not to a local corpus: ignored\n")
    prepare(corpus, "bytes", tmp_path / "data", val_fraction=0.25)  # the same data: not written again
    assert "already prepared" in capsys.readouterr().out and folder.name == "texts_bytes"


def test_a_small_corpus_is_told_the_val_fraction_to_pass(tmp_path):
    corpus = small_corpus(tmp_path / "texts", 60)
    with pytest.raises(ValueError, match=r"^no documents for val \(60 documents in all\): pass --val_fraction 0.083 "
                                         r"\(about 5 of them\), or add documents$"):
        prepare(corpus, "bytes", tmp_path / "data", num_proc=1)
    assert len(load_tokens(prepare(corpus, "bytes", tmp_path / "data", val_fraction=0.083) / "val.bin").doc_offsets)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc, where no folder can be made")
def test_a_data_dir_that_cannot_be_made_is_named_with_the_fix(tmp_path):
    with pytest.raises(SystemExit) as exit:
        prepare_data.main(["--data_dir", "/proc/nope"])
    assert re.fullmatch(r"error: cannot make the folder /proc/nope/default_bytes \(.+\): pass a --data_dir where "
                        r"you can write", exit.value.code)


def test_prepare_data_takes_key_equals_value_as_the_other_scripts_do(tmp_path):
    """--key=value (train.py's, sample.py's and eval.py's form) as well as --key value."""
    prepare_data.main([f"--dataset={small_corpus(tmp_path / 'texts', 20)}", f"--data_dir={tmp_path / 'data'}",
                       "--val_fraction=0.25", "--num_proc=1"])
    meta = json.loads((tmp_path / "data" / "texts_bytes" / "meta.json").read_text())
    assert meta["options"]["val_fraction"] == 0.25


def test_a_missing_token_file_gets_a_runnable_command_or_plain_advice(tmp_path, default_bytes):
    """The command to re-run where meta.json or the folder's name tells it; else advice with no placeholder."""
    with pytest.raises(FileNotFoundError) as error:
        load_tokens(tmp_path / "missing.bin")
    assert str(error.value) == (f"{tmp_path / 'missing.bin'} does not exist: prepare_data.py writes token files: run "
                                "it with --dataset set to your corpus (a .txt/.jsonl/.parquet file or a folder of "
                                "them) and give the train.bin or val.bin it writes (it prints their folder)")
    with pytest.raises(FileNotFoundError, match=rf"re-run `python prepare_data.py --dataset default --tokenizer bytes "
                                                rf"--data_dir {re.escape(str(default_bytes.parent))}`"):
        load_tokens(default_bytes / "missing.bin")


def test_an_empty_data_dir_is_the_repository_data_folder(tmp_path, monkeypatch):
    """So train.py and eval.py, whose default is '', read where prepare_data.py writes, from any folder."""
    assert prepare_data.dataset_dir("default", "bytes", "") == prepare_data.DEFAULT_DATA_DIR / "default_bytes"
    assert prepare_data.dataset_dir("default", "bytes", None) == prepare_data.DEFAULT_DATA_DIR / "default_bytes"
    monkeypatch.setattr(prepare_data, "DEFAULT_DATA_DIR", tmp_path / "repository" / "data")
    monkeypatch.chdir(tmp_path)
    jsonl_corpus(tmp_path / "docs.jsonl")
    folder = prepare("docs.jsonl", "bytes", "", val_fraction=0.25, num_proc=1)
    assert folder == tmp_path / "repository" / "data" / "docs_bytes" and (folder / "meta.json").exists()


def test_corpus_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(ValueError, match="no field 'text'.*--text_field"):
        prepare(str(path), "bytes", tmp_path, num_proc=1)
    with pytest.raises(ValueError, match="no documents for val"):
        prepare(str(path), "bytes", tmp_path, text_field="content", val_fraction=1e-9, num_proc=1)
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        prepare(str(tmp_path / "missing"), "bytes", tmp_path)
    assert not (tmp_path / "docs_bytes").exists()  # nothing half-written, no empty folder


@pytest.mark.parametrize("name, content, message", [
    ("docs.jsonl", b'{"text": "fine"}\n{text: "fine"}\n', r"docs.jsonl, line 2, is not JSON \(Expecting property "
                                                         r"name enclosed in double quotes at column 2\)"),
    ("docs.jsonl", b'{"text": "fine"}\n\n{"text": 5}\n', r"docs.jsonl, line 3, has a 'text' that is not a string "
                                                       r"\(int: 5\): fix that record"),
    ("docs.jsonl", b'["a", "list"]\n', r"docs.jsonl, line 1, is a JSON list, not an object"),
    ("docs.jsonl", b'{"text": "caf\xe9"}\n', r"docs.jsonl, line 1, is not UTF-8 \(byte 0xe9 at column 14\)"),
    ("noise.txt", np.random.default_rng(0).bytes(4096), r"noise.txt is not UTF-8 text \(byte [0-9]+ of 4,096 is 0x"),
], ids=["not JSON", "text not a string", "not an object", "line not UTF-8", "random bytes"])
def test_bad_corpus_records_are_named(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        prepare(str(tmp_path / name), "bytes", tmp_path / "data", num_proc=1)


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
    jsonl_corpus(corpus / "train.jsonl")
    folder = prepare(f"hf:{corpus}", "bytes", tmp_path / "data", val_fraction=0.25, num_proc=2)  # a local folder
    assert folder.name.startswith("hf_") and folder.name.endswith("hub_like_bytes")
    assert_split_round_trip(folder, "bytes", DOCUMENTS)


def test_replacing_leaves_no_file_of_the_earlier_set(tmp_path):
    """prepare_data.replacing, which eval.py's outputs take too: the new files replace the earlier set whole, and a
    path the new set does not write (routing.png without matplotlib) goes, not left beside the new ones."""
    json_path, png_path = tmp_path / 'routing.json', tmp_path / 'routing.png'
    json_path.write_text('earlier')
    png_path.write_text('earlier')
    with prepare_data.replacing([json_path, png_path]) as (json_file, png_file):
        json_file.write_text('new')
    assert json_path.read_text() == 'new' and not png_path.exists() and os.listdir(tmp_path) == ['routing.json']


def test_a_corpus_with_records_without_text_says_so_and_what_to_pass(tmp_path, capsys):
    """Records whose text is null are counted in a note; where no document drew val at the --val_fraction given, the
    advice is not that same value again."""
    from prepare_data import _split_key
    texts = [text for text in (f"document {i}: {TEXT}" for i in range(200)) if _split_key(text) >= 0.5][:6]
    records = [{"text": text} for text in texts] + [{"text": None}] * 3
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(ValueError) as error:
        prepare(str(tmp_path / "docs.jsonl"), "bytes", tmp_path / "data", val_fraction=0.5, num_proc=1)
    assert "--val_fraction 0.5 " not in str(error.value) and "above 0.5" in str(error.value), error.value
    assert "note: 3 records without text (null or empty) skipped" in capsys.readouterr().err


def test_a_token_file_that_is_a_folder_is_refused_before_any_file_is_written(tmp_path):
    corpus = small_corpus(tmp_path / "texts", 60)
    out = prepare(corpus, "bytes", tmp_path / "data", val_fraction=0.083, num_proc=1)
    before = (out / "train.bin").stat().st_mtime_ns
    (out / "val.bin").unlink()
    (out / "val.bin").mkdir()
    with pytest.raises(ValueError, match="val.bin is a folder, not a token file: move it away"):
        prepare(corpus, "bytes", tmp_path / "data", val_fraction=0.083, num_proc=1)
    assert (out / "train.bin").stat().st_mtime_ns == before
