"""Data preparation on real ELF files from this machine: format, determinism, resume, bad input."""

from __future__ import annotations

import collections
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lmscale_jax.prep import output_dir, prepare, shard_writer, tokenize_pack
from lmscale_jax.prep.elf import elf_corpus
from lmscale_jax.prep.elf.pretokenize import Pretokenizer, normalize_number
from lmscale_jax.store import dataset, records
from tests.helpers import lmscale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 128


LIBS = ("libz.so.1", "libssl.so.3", "libbz2.so.1.0", "liblzma.so.5", "libexpat.so.1",
        "libzstd.so.1")


def small_elves(count=len(LIBS)):
  """A few real x86-64 shared libraries of this machine (~800 exported functions)."""
  paths = [os.path.join("/usr/lib/x86_64-linux-gnu", n) for n in LIBS[:count]]
  found = [p for p in paths if os.path.exists(p)]
  assert len(found) >= min(3, count), f"expected system libraries {paths}"
  return found


def opts(out, inputs=None, **kw):
  kw.setdefault("progress", False)
  kw.setdefault("seq_len", SEQ)
  kw.setdefault("vocab_size", 2000)
  kw.setdefault("val_fraction", 0.05)
  return prepare.PrepareOptions(kind=kw.pop("kind", "binary"), inputs=inputs or small_elves(),
                         output=str(out), **kw)


def read_split(meta, split):
  from array_record.python import array_record_module

  out = []
  for p in meta.shard_paths(split):
    r = array_record_module.ArrayRecordReader(p)
    out += [dataset.decode_record(x, meta.seq_len, p) for x in r.read_all()]
    r.close()
  return np.stack(out)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp("prep") / "ds"
  stats = prepare.prepare(opts(out, workers=1))
  return out, stats


@pytest.fixture(scope="module")
def built_symbols(tmp_path_factory):
  out = tmp_path_factory.mktemp("prep") / "ds"
  return out, prepare.prepare(opts(out, workers=1, functions="symbols"))


# ----------------------------------------------------------------------------- pretokens
def test_number_normalisation():
  assert normalize_number(0x18) == "0x18"
  assert normalize_number(0x1000) == "0x1000"            # power of two kept
  assert normalize_number(0xFFFFFFFFFFFFFFF0) == "0xfffffffffffffff0"  # alignment mask
  assert normalize_number(0xFFFF) == "0xffff"            # low-bit mask
  assert normalize_number(0x1234) == "<imm16>"
  assert normalize_number(0x123456) == "<imm32>"
  assert normalize_number(0x123456789A) == "<imm64>"


def test_instruction_pretokens():
  pre = Pretokenizer()
  insns = [(0x100, 4, "mov", "rax, qword ptr [rbp - 0x18]"),
           (0x104, 7, "lea", "rdi, [rip + 0x2fe2]"),
           (0x10B, 2, "jne", "0x100"),
           (0x10D, 2, "je", "0x110"),
           (0x10F, 2, "jmp", "0x104"),
           (0x111, 5, "call", "0x9000"),
           (0x116, 3, "rep stosq", "qword ptr [rdi], rax"),
           (0x119, 1, "ret", "")]
  text = pre.function_text(insns, 0x100, 0x120)
  assert text.split(" [NEXT] ") == [
      "mov rax qword [ rbp - 0x18 ]", "lea rdi [ rip + <rip> ]", "jne <self>", "je <fwd>",
      "jmp <back>", "call <ext>", "rep stosq qword [ rdi ] rax", "ret"]


# ----------------------------------------------------------------------------- the dataset
def test_dataset_directory_contract(built):
  out, stats = built
  meta = dataset.DatasetMeta.load(str(out))
  assert meta.seq_len == SEQ and meta.vocab_size <= dataset.MAX_VOCAB
  assert meta.special_ids == {t: i for i, t in enumerate(dataset.SPECIAL_TOKENS)}
  assert meta.verify() == []
  assert not os.path.exists(out / output_dir.WORK)
  for key in ("input_bytes", "output_bytes", "reduction_pct", "functions_seen", "functions_kept",
              "functions_deduplicated", "sequences", "tokens", "pad_fraction",
              "unk_rate_validation", "files_skipped", "wall_seconds", "mb_per_s_per_core"):
    assert key in stats, key
  assert stats["functions_kept"] + stats["functions_deduplicated"] == stats["functions_seen"]
  assert stats["pad_fraction"] < 0.1  # the tail of open sequences weighs more on tiny data
  assert json.load(open(out / dataset.STATS)) == stats
  train = read_split(meta, "train")
  assert train.dtype == np.uint16 and train.shape == (meta.num_records("train"), SEQ)
  assert (train[:, 0] == meta.special_ids["[CLS]"]).all()
  assert int((train != 0).sum() + (read_split(meta, "validation") != 0).sum()) == stats["tokens"]


def test_tfds_and_grain_read_the_shards(built):
  import grain
  import tensorflow_datasets as tfds

  out, _ = built
  meta = dataset.DatasetMeta.load(str(out))
  val = read_split(meta, "validation")
  src = tfds.builder_from_directory(str(out)).as_data_source()
  assert len(src["validation"]) == len(val)
  np.testing.assert_array_equal(src["validation"][0]["input_ids"], val[0])
  g = grain.sources.ArrayRecordDataSource(meta.shard_paths("validation"))
  np.testing.assert_array_equal(dataset.decode_record(g[len(val) - 1], SEQ), val[-1])


def test_round_trip_decodes_to_source_pretokens(built):
  from tokenizers import Tokenizer

  out, _ = built
  meta = dataset.DatasetMeta.load(str(out))
  tok = Tokenizer.from_file(str(out / dataset.TOKENIZER))
  sep = meta.special_ids["[SEP]"]
  decoded = set()
  for split in ("train", "validation"):
    for row in read_split(meta, split):
      row = row[1:row.tolist().index(0) if 0 in row.tolist() else SEQ]
      bounds = np.flatnonzero(row == sep)
      start = 0
      for b in bounds:
        decoded.add(tok.decode(row[start:b].tolist(), skip_special_tokens=False))
        start = b + 2  # past the [SEP] and the next piece's [CLS] (dataset format 2)
  sources, seen = [], set()
  for path in small_elves():
    _, lines = elf_corpus.extract_file(path)
    for digest, text in lines:
      if digest not in seen:
        seen.add(digest)
        sources.append(text)
  fits = [t for t in sources if len(tok.encode(t, add_special_tokens=False).ids) <= SEQ - 2]
  assert len(fits) > 100
  missing = [t for t in fits if t not in decoded]
  assert not missing, missing[:3]


def test_split_by_function_never_both(built_symbols):
  """Validation and train share no function: each packed segment belongs to one split. On the
  exported functions alone (--functions symbols): with the .eh_frame ones too (3x as many),
  distinct functions share whole 126-token pieces or tokenize alike ([UNK]s of the 2,000-token
  vocabulary): 3 of the 683 validation segments over 20 tokens (issue 58)."""
  out, _ = built_symbols
  meta = dataset.DatasetMeta.load(str(out))
  sep = meta.special_ids["[SEP]"]

  def segments(split):
    segs = set()
    for row in read_split(meta, split):
      for seg in np.split(row, np.flatnonzero(row == sep) + 1):
        seg = seg[(seg != 0) & (seg != meta.special_ids["[CLS]"])]
        if len(seg) > 20:  # short segments (e.g. `ret`) can coincide as tails of long ones
          segs.add(seg.tobytes())
    return segs

  assert meta.num_records("validation") > 0
  assert not segments("train") & segments("validation")


def _same_output(a, b):
  names = sorted(os.listdir(a))
  assert names == sorted(os.listdir(b))
  for n in names:
    if n == dataset.STATS:
      continue
    assert filecmp.cmp(a / n, b / n, shallow=False), n


def test_identical_for_any_worker_count(built, tmp_path):
  out1, _ = built
  prepare.prepare(opts(tmp_path / "w2", workers=2))
  _same_output(out1, tmp_path / "w2")


@pytest.mark.parametrize("shown", [True, False])
def test_progress_bars_of_every_pass_are_drawn_only_when_asked(tmp_path, shown):
  code = (f"from lmscale_jax.prep import prepare; "
          f"prepare.prepare(prepare.PrepareOptions(kind='binary', "
          f"inputs={small_elves(3)!r}, output={str(tmp_path / 'ds')!r}, workers=2, seq_len=128, "
          f"vocab_size=2000, progress={shown}))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr
  for desc in ("extract", "tokenize+pack", "shards"):
    assert (f"{desc}:" in r.stderr) == shown, (desc, r.stderr[-2000:])


def test_pool_workers_do_not_import_tqdm():
  # Its import was 37 ms of each worker's ~0.3 s start; the bars are drawn in the parent.
  modules = prepare.WORKER_MODULES["common"] + prepare.WORKER_MODULES["binary"]
  code = f"import sys, {', '.join(modules)}; print('tqdm' in sys.modules)"
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     cwd=ROOT)
  assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr


def test_identical_for_any_worker_count_with_many_pass3_pieces(built, tmp_path, monkeypatch):
  # Pass 3's tasks are chosen in this process: small pieces give the workers many tasks.
  monkeypatch.setattr(shard_writer, "PIECE_BYTES", 64 << 10)
  tasks, pieces = [], shard_writer.pieces
  monkeypatch.setattr(shard_writer, "pieces", lambda *a: tasks.append(pieces(*a)) or tasks[-1])
  tok = str(built[0] / dataset.TOKENIZER)
  one = prepare.prepare(opts(tmp_path / "one", workers=1, tokenizer=tok))
  two = prepare.prepare(opts(tmp_path / "two", workers=2, tokenizer=tok))
  _same_output(tmp_path / "one", tmp_path / "two")
  assert tasks[0] != tasks[1] and len(tasks[0]) == len(tasks[1]) > 8  # other work dirs
  assert one["content_tokens"] == two["content_tokens"] == built[1]["content_tokens"]


def test_pass3_removes_each_chunk_once_packed_and_each_piece_once_its_shards_are_written(
    built, tmp_path, monkeypatch):
  """What no later step reads goes as pass 3 goes, not all at the end (one process unlinking
  while the other cores idled): as shard k starts, no chunk's text is left, every sequence
  file shards k… read is there and none that only earlier shards read."""
  from lmscale_jax.prep import packed_pieces

  monkeypatch.setattr(shard_writer, "PIECE_BYTES", 64 << 10)
  work = tmp_path / "out" / output_dir.WORK
  seen, write, listed, pieces = [], packed_pieces.write_shard, [], shard_writer.pieces
  monkeypatch.setattr(shard_writer, "pieces", lambda *a: listed.append(pieces(*a)) or listed[-1])

  def spy(task):
    seen.append((task, {str(p) for p in (work / packed_pieces.PIECES).glob("*.npy")},
                 list(work.glob("corpus-*.txt"))))
    return write(task)

  monkeypatch.setattr(packed_pieces, "write_shard", spy)
  prepare.prepare(opts(tmp_path / "out", workers=1, chunk_mb=0.3, shard_size_mb=0.05,
                       tokenizer=str(built[0] / dataset.TOKENIZER)))
  tasks = [task for task, _, _ in seen]

  def reads(shards):
    return {packed_pieces.sequences_file(piece, split)
            for split, _, ranges, _ in shards for piece, _, _ in ranges}

  assert len(tasks) > 10 and len({chunk for chunk, _, _ in listed[0]}) > 1
  for k, (_, files, texts) in enumerate(seen):
    assert texts == [], k
    assert reads(tasks[k:]) <= files, k
    assert not (reads(tasks[:k]) - reads(tasks[k:])) & files, k
  assert not work.exists()


def test_packing_none_pads_more(built_symbols, tmp_path):
  # The exported functions alone: with the .eh_frame ones, 3x as many, mostly longer than a
  # sequence, "none" pads 0.088 of its tokens to greedy's 0.003 (issue 58)
  _, greedy = built_symbols
  none = prepare.prepare(opts(tmp_path / "none", workers=1, packing="none", functions="symbols",
                              tokenizer=str(built_symbols[0] / dataset.TOKENIZER)))
  assert none["content_tokens"] == greedy["content_tokens"]
  assert none["pad_fraction"] > greedy["pad_fraction"] + 0.1
  assert sum(none["sequences"].values()) > sum(greedy["sequences"].values())


@pytest.mark.parametrize("compression", ["snappy", "none"])
def test_every_compression_reads_back_the_same_records(built, tmp_path, compression):
  """The shards differ in bytes only: the same sequences, read by the loader's reader without
  being told the codec; zstd, the default, is what every earlier preparation wrote."""
  out, zstd = built
  other = prepare.prepare(opts(tmp_path / compression, workers=1, compression=compression,
                               tokenizer=str(out / dataset.TOKENIZER)))
  assert (zstd["compression"], other["compression"]) == ("zstd", compression)
  a, b = dataset.DatasetMeta.load(str(out)), dataset.DatasetMeta.load(str(tmp_path / compression))
  for split in dataset.SPLITS:
    np.testing.assert_array_equal(read_split(a, split), read_split(b, split))
    reader = records.ShardRecords(b, split)
    first = reader.decode(reader.read(np.arange(3), []), np.arange(3), b.vocab_size, [])
    np.testing.assert_array_equal(first, read_split(a, split)[:3])
  assert other["output_bytes"] > zstd["output_bytes"]  # zstd is the smallest of the three


def test_a_bad_compression_is_one_line(tmp_path):
  with pytest.raises(prepare.PrepareError, match=r"--compression 'lz4': expected one of "
                     r"\['zstd', 'snappy', 'none'\]"):
    prepare.prepare(opts(tmp_path / "o", small_elves(1), compression="lz4"))
  r = _cli("prepare_binary.py", "--input", *small_elves(1), "--output", tmp_path / "o",
           "--compression", "lz4")
  assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "lz4" in r.stderr


def _cli(tool, *args, **kw):
  return subprocess.run([*lmscale(tool), *map(str, args)], capture_output=True, text=True,
                        timeout=300, **kw)


@pytest.mark.parametrize("wait_for", ["corpus-00001.json", "shards/train-00001.json"])
def test_kill_and_rerun_completes_identically(built, tmp_path, wait_for):
  """SIGKILL mid-extraction / mid-sharding; the rerun keeps finished work and ends identical."""
  out = tmp_path / "killed"
  args = ["--input", *small_elves(), "--output", out, "--seq-len", SEQ, "--vocab-size", 2000,
          "--val-fraction", 0.05, "--workers", 1, "--no-progress", "--chunk-mb", 0.3,
          "--shard-size-mb", 0.05]  # ~15 train shards: a kill after the second has work left
  # (with 3, a loaded 2-core CI runner's kill after the second landed in finalize)
  ref = tmp_path / "ref"
  assert _cli("prepare_binary.py", *[ref if a == out else a for a in args]).returncode == 0
  proc = subprocess.Popen([*lmscale("prepare_binary"), *map(str, args)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 120
  while not (out / output_dir.WORK / wait_for).exists():
    assert proc.poll() is None, proc.stderr.read()
    assert time.time() < deadline
    time.sleep(0.01)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  assert not (out / dataset.METADATA).exists()
  kept = sorted((out / output_dir.WORK).rglob("*.json"))
  if wait_for.startswith("shards"):  # the rerun does without them: pass 3 removed them
    assert not list((out / output_dir.WORK).glob("corpus-*.txt"))
  # What kills during finalize's writes of stats.json and of the manifest leave (CI runs'
  # kills landed in both).
  (out / f".{dataset.STATS}.k1ll3d.tmp").write_text("{")
  (out / f".{output_dir.MANIFEST}.k1ll3d.tmp").write_text("{")
  r = _cli("prepare_binary.py", *args)
  assert r.returncode == 0, r.stderr
  v = _cli("inspect_shards.py", out, "--verify")
  assert v.returncode == 0 and "verify:" in v.stdout, v.stdout + v.stderr
  _same_output(ref, out)
  assert kept  # the killed run had finished work that the rerun kept


def test_max_input_bytes_skips_a_file_that_would_cross_it_and_takes_later_ones(tmp_path):
  """A large file early in the order is skipped, not the end of the listing (the demo's
  24 MB cap used to stop at 3 MB, before libLLVM); the first file is taken whatever its size."""
  small, big = (os.path.join("/usr/lib/x86_64-linux-gnu", n) for n in ("libz.so.1",
                                                                      "libssl.so.3"))
  d = tmp_path / "in"
  d.mkdir()
  for name, src in (("1-small", small), ("2-big", big), ("3-small", small)):
    shutil.copy(src, d / name)
  cap = 2 * os.path.getsize(small)
  skipped, notes = {}, []
  taken = elf_corpus.list_inputs([str(d)], cap, skipped, notes)
  assert [os.path.basename(c.path) for c in taken] == ["1-small", "3-small"]
  assert skipped == {"over_max_input_bytes": 1} and not notes  # found in a directory: counted
  taken = elf_corpus.list_inputs([str(d / "1-small"), str(d / "2-big")], cap, skipped, notes)
  assert [os.path.basename(c.path) for c in taken] == ["1-small"]
  assert len(notes) == 1 and "2-big" in notes[0] and "--max-input-bytes" in notes[0]
  taken = elf_corpus.list_inputs([str(d / "2-big"), str(d / "1-small")], cap)
  assert [os.path.basename(c.path) for c in taken] == ["1-small"]  # the first is no exception


def test_max_input_bytes_that_no_file_fits_is_one_line_naming_the_smallest(tmp_path):
  """--max-input-bytes 1 took the first file whatever its size (its help says a file that
  would not fit is skipped)."""
  small = min(small_elves(3), key=os.path.getsize)
  size = os.path.getsize(small)
  r = _cli("prepare_binary.py", "--input", *small_elves(3), "--output", tmp_path / "o",
           "--max-input-bytes", size - 1, "--no-progress")
  assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
  assert f"error: --max-input-bytes {size - 1:,}: no input file fits in it (the smallest ELF " \
         f"file, {small!r}, has {size:,} bytes); raise it to at least {size}" in r.stderr
  assert not (tmp_path / "o").exists()


def test_text_max_input_bytes_takes_the_later_files_that_fit(tmp_path):
  from lmscale_jax.prep import text_corpus

  paths = []
  for name, size in (("a.txt", 10), ("b.txt", 100), ("c.txt", 10)):
    (tmp_path / name).write_text("x" * (size - 1) + "\n")
    paths.append(str(tmp_path / name))
  skipped, notes = {}, []
  assert text_corpus.check_inputs(paths, 25, skipped, notes) == [paths[0], paths[2]]
  assert skipped == {"over_max_input_bytes": 1} and len(notes) == 1 and "b.txt" in notes[0]
  with pytest.raises(text_corpus.InputError, match="missing.txt"):  # every path still checked
    text_corpus.check_inputs([*paths, str(tmp_path / "missing.txt")], 25)
  assert text_corpus.check_inputs(paths[1:], 25) == [paths[2]]  # the first is no exception
  with pytest.raises(text_corpus.InputError, match=r"no input file fits in it \(the smallest "
                     r"file, '.*a.txt', has 10 bytes\); raise it to at least 10"):
    text_corpus.check_inputs(paths, 9)


def test_an_x32_object_is_skipped_as_x32_not_counted_as_corrupt(tmp_path):
  """ELFCLASS32 with e_machine x86-64 (the x32 ABI): real code, in ELF32 tables this reader
  does not parse; it was counted in files_skipped.corrupt. Built by gcc -mx32, or where the
  compiler lacks it from gcc -m32's object with e_machine set to EM_X86_64."""
  if shutil.which("gcc") is None:
    pytest.skip("needs gcc")
  (tmp_path / "f.c").write_text("int twice(int x) { return 2 * x; }\n"
                                "long add(long a, long b) { return a + b; }\n")
  d = tmp_path / "in"
  d.mkdir()
  x32 = d / "x32.o"
  if subprocess.run(["gcc", "-mx32", "-c", tmp_path / "f.c", "-o", x32]).returncode:
    if subprocess.run(["gcc", "-m32", "-c", tmp_path / "f.c", "-o", x32]).returncode:
      pytest.skip("gcc makes neither x32 nor 32-bit objects here")
    data = bytearray(x32.read_bytes())
    data[18:20] = (62).to_bytes(2, "little")  # e_machine = EM_X86_64
    x32.write_bytes(data)
  assert x32.read_bytes()[4] == 1 and x32.read_bytes()[18:20] == (62).to_bytes(2, "little")
  shutil.copy(small_elves(1)[0], d / "lib.so")
  stats = prepare.prepare(opts(tmp_path / "out", [str(d)], workers=1, vocab_size=500,
                               val_fraction=0.2))
  assert stats["files_skipped"] == {"abi=x32": 1}


# ----------------------------------------------------------------------------- bad input
def test_skips_are_counted(tmp_path):
  src = small_elves(1)[0]
  d = tmp_path / "in"
  d.mkdir()
  shutil.copy(src, d / "good")
  (d / "notes.txt").write_text("not an ELF file\n")
  data = bytearray(open(src, "rb").read())
  arm = bytearray(data)
  arm[18:20] = (183).to_bytes(2, "little")  # e_machine = EM_AARCH64
  (d / "arm").write_bytes(arm)
  (d / "truncated").write_bytes(data[:64])
  stats = prepare.prepare(opts(tmp_path / "out", [str(d)], workers=1, val_fraction=0.2,
                               vocab_size=500))
  assert stats["files_skipped"] == {"not_elf": 1, "machine=AArch64": 1, "corrupt": 1}


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"),
    ("no_functions", "no ELF files found"),
    ("vocab", "65535"),
    ("not_empty", "not empty: it holds 'x', which no preparation wrote"),
    ("not_writable", "not writable"),
])
def test_bad_input_clear_error(tmp_path, case, message):
  out = tmp_path / "out"
  inputs = small_elves(2)
  kw = {}
  if case == "missing":
    inputs = [str(tmp_path / "nope")]
  elif case == "no_functions":
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello")
    inputs = [str(tmp_path / "txt")]
  elif case == "vocab":
    kw["vocab_size"] = 70000
  elif case == "not_empty":
    out.mkdir()
    (out / "x").write_text("keep me")
  elif case == "not_writable":
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "sub"  # a path under a regular file (root ignores chmod)
  with pytest.raises(prepare.PrepareError, match=message):
    prepare.prepare(opts(out, inputs, **kw))
  if case == "not_empty":
    assert (out / "x").read_text() == "keep me"


def test_cli_error_is_one_line(tmp_path):
  r = _cli("prepare_binary.py", "--input", tmp_path / "nope", "--output", tmp_path / "o")
  assert r.returncode == 1
  assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr


# ----------------------------------------------------------------------------- text
def test_text_corpora_and_unk_counting(tmp_path):
  txt = tmp_path / "a.txt"
  txt.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n" for i in range(300)))
  jl = tmp_path / "b.jsonl"
  jl.write_text("".join(json.dumps({"body": f"lorem ipsum dolor {i} sit amet"}) + "\n"
                        for i in range(300)))
  st = prepare.prepare(opts(tmp_path / "t", [str(txt), str(jl)], kind="text", vocab_size=300,
                            text_field="body", workers=1))
  assert st["documents_kept"] == 600 and st["unk_rate_validation"] == 0
  other = tmp_path / "c.txt"
  other.write_text("".join(f"Ωmega ψ {i} ∂elta\n" for i in range(200)))
  st2 = prepare.prepare(opts(tmp_path / "t2", [str(other)], kind="text",
                             tokenizer=str(tmp_path / "t" / dataset.TOKENIZER), workers=1))
  assert st2["unk_rate_train"] > 0.2
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"body": "ok"}\n{oops\n')
  with pytest.raises(prepare.PrepareError, match=r"bad.jsonl:2: not valid JSON"):
    prepare.prepare(opts(tmp_path / "t3", [str(bad)], kind="text", text_field="body", workers=1))


def test_pretoken_memo_matches_the_tokenizer(built):
  """The fast binary path gives exactly what tokenizers' own encode gives."""
  from tokenizers import Tokenizer

  tok = Tokenizer.from_file(str(built[0] / dataset.TOKENIZER))
  memo = tokenize_pack.PretokenIds(tok)
  texts = [t for p in small_elves(2) for _, t in elf_corpus.extract_file(p)[1]]
  texts.append("mov rax qword [ rbp - 0x18 ] [NEXT] vfrobnicate zmm31 [NEXT] ret")  # unseen word
  for t in texts:
    np.testing.assert_array_equal(memo.encode(t), tok.encode(t, add_special_tokens=False).ids)


def test_binary_vocabulary_is_the_most_frequent_words():
  """Words counted per instruction then spread (tokenizer._pretoken_wordpiece) give the same
  vocabulary as counting every word: after specials and characters, by count, then name."""
  import collections

  from lmscale_jax.store import tokenizer as toklib

  texts = [t for p in small_elves(2) for _, t in elf_corpus.extract_file(p)[1]]
  tok = toklib.train(texts, vocab_size=300, kind="binary")
  counts = collections.Counter(w for t in texts for w in t.split() if w != "[NEXT]")
  vocab = sorted(tok.get_vocab(), key=tok.token_to_id)
  words = [w for w in vocab[len(dataset.SPECIAL_TOKENS):] if len(w) > 1 and
           not w.startswith("##")]
  want = sorted((w for w, n in counts.items() if n >= 2 and len(w) > 1),
                key=lambda w: (-counts[w], w))
  assert len(words) > 100 and words == want[:len(words)]


def test_pretoken_counts_of_parts_add_up_to_the_tokenizer_of_the_whole():
  """The tokenizer a cluster preparation builds from each slice's counts, merged, is the one a
  single node trains on all the texts (the same file, byte for byte)."""
  from lmscale_jax.store import tokenizer as toklib

  texts = [t for p in small_elves(3) for _, t in elf_corpus.extract_file(p)[1]]
  thirds = [texts[i::3] for i in range(3)]
  merged = sum((toklib.count_pretokens(part) for part in thirds), collections.Counter())
  whole = toklib.train(texts, vocab_size=300, kind="binary")
  assert toklib.from_pretoken_counts(merged, 300).to_str() == whole.to_str()


@pytest.mark.parametrize("sample_mb", [64, 1], ids=["every line", "every k-th line"])
def test_the_tokenizer_sample_counted_per_piece_in_workers_is_the_one_of_one_process(
    tmp_path, monkeypatch, sample_mb):
  """Pass 2 counts the sample's pretokens per ~4 MB piece in the pool; the sample's lines (the
  global k-th lines, across pieces and chunks) and so the counts are iter_texts' own."""
  from lmscale_jax.prep import corpus_extract, worker_pool
  from lmscale_jax.store import tokenizer as toklib

  monkeypatch.setattr(shard_writer, "PIECE_BYTES", 100_000)
  words = ["mov rax rbx", "call <ext>", "ret", "push rbp"]
  chunks = []
  for c in range(2):
    chunks.append(str(tmp_path / f"corpus-{c:05d}.txt"))
    with open(chunks[-1], "w") as f:
      for i in range(9000 + c * 7):
        f.write(corpus_extract.format_corpus_line(
            i.to_bytes(16, "big"), " [NEXT] ".join(words[(i + j) % 4] + f" {i % 97}"
                                                   for j in range(1 + i % 9))))
  o = opts(tmp_path, tokenizer_sample_mb=sample_mb, workers=2)
  with worker_pool.ordered_map(2) as pmap:
    counts = prepare._sample_counts(o, str(tmp_path), chunks, pmap)
  assert counts == toklib.count_pretokens(corpus_extract.iter_texts(chunks, sample_mb << 20))
  assert len(shard_writer.pieces(chunks)) > 8


def test_pass3_pieces_cover_the_chunks_at_line_ends(tmp_path):
  """Pass 3's tasks: byte ranges of the corpus chunks that end at line ends and, in order,
  are every chunk exactly (a line split over two pieces would be lost or garbled)."""
  chunk = tmp_path / "corpus-00000.txt"
  lines = [f"{i:032x}\t" + "mov eax [NEXT] " * (i % 97) + "ret\u2028ok\n" for i in range(3000)]
  chunk.write_bytes("".join(lines).encode("utf-8"))
  small = tmp_path / "corpus-00001.txt"
  small.write_bytes(b"")
  got = shard_writer.pieces([str(chunk), str(small)], piece_bytes=10_000)
  data = chunk.read_bytes()
  assert len(got) > 20 and all(p == str(chunk) for p, _, _ in got)
  assert got[0][1] == 0 and got[-1][2] == len(data)
  assert all(a[2] == b[1] for a, b in zip(got, got[1:]))
  assert all(data[end - 1:end] == b"\n" for _, _, end in got)
  again = [line for piece in got for batch in shard_writer._piece_lines(*piece) for line in batch]
  assert again == lines  # U+2028 inside a text is not a line end


def test_file_parts_concatenate_to_the_whole_file():
  """A large file is split over workers by address ranges; the parts in order are the file."""
  path = small_elves(2)[1]
  whole = elf_corpus.extract_file(path)[1]
  parts = []
  for p in range(3):
    res = elf_corpus.FileResult(path=path, file_bytes=0)
    parts += list(elf_corpus.iter_functions(path, res, p, 3))
  assert parts == whole and len(whole) > 100


def test_small_files_go_to_the_pool_in_batches_and_split_files_part_by_part():
  from lmscale_jax.prep import corpus_extract

  mb = corpus_extract.BATCH_BYTES
  sizes = [mb // 4] * 3 + [mb // 2, 3 * mb, mb // 8, 20 * mb, mb // 8]
  tasks = [(i, ("binary", f"f{i}", part, parts, f"t{i}-{part}", None, None))
           for i, size in enumerate(sizes)
           for parts in [corpus_extract.file_parts("binary", size)] for part in range(parts)]
  got = corpus_extract.batches(tasks, sizes)
  assert [args for batch in got for args in batch] == [args for _, args in tasks]  # each once
  files = [[(args[1], args[2]) for args in batch] for batch in got]
  assert files == [[("f0", 0), ("f1", 0), ("f2", 0), ("f3", 0)],  # 1.25 MB: closed at ≥ 1 MB
                   [("f4", 0)], [("f5", 0)], [("f6", 0)], [("f6", 1)], [("f6", 2)], [("f7", 0)]]


def test_the_extract_bar_times_its_rate_from_the_first_result_not_the_pools_start(
    tmp_path, capsys):
  """The demo's bar opened at "43:22:36" left: its clock had run through the pool's start-up
  (496 bytes done in 3 s). Here a pool that takes 4 s to start: the bar's last frame (one
  small library) shows under 4 s elapsed, its time left counted from the first result."""
  import re

  from lmscale_jax.prep import corpus_extract

  o = opts(tmp_path / "o", small_elves(1), workers=1, progress=True)
  files, skipped, _ = corpus_extract.list_files(o)
  os.makedirs(tmp_path / "work")

  def slow_start(fn, tasks):
    time.sleep(4)
    yield from map(fn, tasks)

  corpus_extract.extract(o, str(tmp_path / "work"), files, skipped, {}, slow_start)
  frames = re.findall(r"extract: *100%.*?\[(\d+):(\d+)<", capsys.readouterr().err)
  assert frames, "no finished extract bar drawn"
  assert int(frames[-1][0]) * 60 + int(frames[-1][1]) < 4, frames


def test_an_unfinished_run_of_the_other_pretokenizer_backend_names_the_way_to_resume_it(
    tmp_path, monkeypatch):
  """The backends' texts differ on ~0.005% of instructions, so a run never mixes them: a run
  started with the python backend (its first steps, then killed) is refused by the compiled
  one, with both ways out; under the python backend again it resumes and completes."""
  from lmscale_jax.prep import corpus_extract
  from lmscale_jax.prep.elf import pretokenize

  o = opts(tmp_path / "o", small_elves(2), workers=1)
  try:
    monkeypatch.setenv(pretokenize.BACKEND_ENV, "python")
    pretokenize.code_pretokenizer(fresh=True)
    files, _, _ = corpus_extract.list_files(o)
    output_dir.open_output(o, {**o.output_params(), "input_files": prepare.input_key(files),
                               **prepare.pretokenizer_params(o)})
    monkeypatch.setenv(pretokenize.BACKEND_ENV, "compiled")
    pretokenize.code_pretokenizer(fresh=True)
    with pytest.raises(prepare.PrepareError, match=r"\(pretokenizer differ\); pass --overwrite "
                       r"to start over or set LMSCALE_PRETOKENIZER=python to resume it"):
      prepare.prepare(o)
    monkeypatch.setenv(pretokenize.BACKEND_ENV, "python")
    pretokenize.code_pretokenizer(fresh=True)
    assert prepare.prepare(o)["pretokenizer"] == "python (iced-x86)"
  finally:
    monkeypatch.delenv(pretokenize.BACKEND_ENV, raising=False)
    pretokenize.code_pretokenizer(fresh=True)
