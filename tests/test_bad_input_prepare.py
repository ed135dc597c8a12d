"""Bad input and careless use of the preparation tools: each case ends in one clear line (or
a correct dataset), never a traceback, a silently wrong dataset or a deleted input.

Real files throughout: this machine's ELF libraries, text files written here, FIFOs, /dev/zero,
a small tmpfs for the full disk, and the tools run as the user runs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from lmscale_jax.exits import EXIT_USAGE
from lmscale_jax.prep import output_dir, prepare, text_corpus
from lmscale_jax.store import dataset
from tests.helpers import lmscale
from tests.test_prepare import ROOT, SEQ, _same_output, opts, small_elves
from tests.test_worker_pool import alive_in_group, kill_group, wait_until_gone


def cli(tool, *args, timeout=300, **kw):
  return subprocess.run([*lmscale(tool), *map(str, args)], capture_output=True, text=True,
                        timeout=timeout, **kw)


def one_line(r, code=EXIT_USAGE) -> str:
  assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
  err = r.stderr.strip()
  assert err.count("\n") == 0 and err.startswith("error: "), err
  return err


def text_file(path, n=400, fmt="jsonl"):
  lines = [f"document {i} about the quick brown fox and lazy dog number {i * 7}" for i in range(n)]
  if fmt == "jsonl":
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
  else:
    path.write_text("".join(t + "\n" for t in lines))
  return path


def text_opts(out, inputs, **kw):
  kw.setdefault("vocab_size", 300)
  kw.setdefault("workers", 1)
  return opts(out, [str(p) for p in inputs], kind="text", **kw)


def tree(d) -> dict:
  return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*"))}


# ----------------------------------------------------------------------------- case 1: --overwrite
@pytest.mark.parametrize("layout", ["input_is_output", "output_holds_jsonl", "output_above_input",
                                    "output_inside_input"])
def test_overwrite_never_touches_an_input(tmp_path, layout):
  d = tmp_path / "D"
  (d / "elf").mkdir(parents=True)
  shutil.copy(small_elves(1)[0], d / "elf" / "lib.so")
  (d / "README").write_text("keep me\n")
  text_file(d / "corpus.jsonl")
  tool, inp, out = {
      "input_is_output": ("prepare_binary.py", d, d),
      "output_holds_jsonl": ("prepare_text.py", d / "corpus.jsonl", d),
      "output_above_input": ("prepare_binary.py", d / "elf", d),
      "output_inside_input": ("prepare_binary.py", d, d / "elf" / "ds"),
  }[layout]
  before = tree(d)
  r = cli(tool, "--input", inp, "--output", out, "--overwrite", "--no-progress")
  err = one_line(r)
  assert f"--output {str(out)!r}" in err and str(inp) in err and "outside every input" in err
  assert tree(d) == before


def test_overwrite_removes_only_what_the_tool_wrote(tmp_path):
  src = text_file(tmp_path / "c.jsonl", n=2000)
  out = tmp_path / "out"
  prepare.prepare(text_opts(out, [src], shard_size_mb=0.01))
  many = sorted(n for n in os.listdir(out) if "train.array_record-" in n)
  assert len(many) > 2
  (out / "README").write_text("my notes\n")
  prepare.prepare(text_opts(out, [src], overwrite=True))
  names = set(os.listdir(out))
  assert (out / "README").read_text() == "my notes\n"
  assert not names & set(many[1:])  # the earlier run's extra shards are gone
  manifest = json.load(open(out / output_dir.MANIFEST))["files"]
  assert set(manifest) >= names - {"README", output_dir.MANIFEST} and "README" not in manifest
  assert dataset.DatasetMeta.load(str(out)).verify() == []


def test_overwrite_replaces_a_dataset_written_before_manifests(tmp_path):
  """No manifest, but only the names a preparation writes (and a killed atomic write's temp):
  an earlier version's dataset, replaced as before."""
  src = text_file(tmp_path / "c.jsonl")
  out = tmp_path / "out"
  prepare.prepare(text_opts(out, [src]))
  (out / output_dir.MANIFEST).unlink()
  (out / ".stats.json.k3j_x9.tmp").write_text("{")
  prepare.prepare(text_opts(out, [src], overwrite=True, seq_len=64))
  assert dataset.DatasetMeta.load(str(out)).seq_len == 64
  assert not (out / ".stats.json.k3j_x9.tmp").exists()


def test_overwrite_refuses_files_no_run_wrote(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "README").write_text("keep me\n")
  (out / "thesis.tex").write_text("years of work\n")
  r = cli("prepare_text.py", "--input", text_file(tmp_path / "c.jsonl"), "--output", out,
          "--overwrite", "--no-progress")
  err = one_line(r)
  assert "'README'" in err and "(and 1 more)" in err and output_dir.MANIFEST in err
  assert sorted(os.listdir(out)) == ["README", "thesis.tex"]


# ----------------------------------------------------------------------------- case 3: resume
def _start(args, **kw):
  return subprocess.Popen([*lmscale("prepare_binary"), *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(proc, path, timeout=120):
  deadline = time.time() + timeout
  while not path.exists():
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline, f"{path} never appeared"
    time.sleep(0.01)


def _held_after_first_chunk(proc, out):
  """Waits for the run's first chunk, then holds it still (SIGSTOP: its whole group where it
  leads one) before anything is sent to it. The run ends under a second after that chunk: a
  signal sent after a scan of /proc on a loaded machine met the interpreter's exit once in 75
  runs, with the default action back (exit -15), not the run. SIGCONT after sending lets it act."""
  _wait_for(proc, out / output_dir.WORK / "corpus-00000.json")
  leads = os.getpgid(proc.pid) == proc.pid
  (os.killpg if leads else os.kill)(proc.pid, signal.SIGSTOP)
  assert not (out / dataset.METADATA).exists(), "the run finished before it was held"
  return lambda: (os.killpg if leads else os.kill)(proc.pid, signal.SIGCONT)


def _bin_args(out, *inputs, workers=1):
  return ["--input", *inputs, "--output", out, "--seq-len", SEQ, "--vocab-size", 2000,
          "--val-fraction", 0.05, "--workers", workers, "--no-progress", "--chunk-mb", 0.3]


def test_resume_starts_afresh_when_inputs_change(tmp_path):
  libs = small_elves()
  d = tmp_path / "elf"
  d.mkdir()
  for p in libs[:3]:
    shutil.copy(p, d)
  out = tmp_path / "out"
  proc = _start(_bin_args(out, d))
  _held_after_first_chunk(proc, out)
  proc.kill()
  proc.wait()
  for p in libs[3:5]:  # two more ELF files
    shutil.copy(p, d)
  r = cli("prepare_binary.py", *_bin_args(out, d))
  assert r.returncode == 0, r.stderr
  assert "input files changed" in r.stderr and "starting it afresh" in r.stderr
  stats = json.loads(r.stdout)
  fresh = cli("prepare_binary.py", *_bin_args(tmp_path / "fresh", d))
  assert fresh.returncode == 0, fresh.stderr
  ref = json.loads(fresh.stdout)
  assert stats["input_files"] == 5
  for k in ("functions_seen", "functions_kept", "sequences", "tokens"):
    assert stats[k] == ref[k], k


def test_empty_jsonl_then_filled_is_prepared_from_the_new_contents(tmp_path):
  src = tmp_path / "c.jsonl"
  src.write_text("")
  out = tmp_path / "out"
  with pytest.raises(prepare.PrepareError, match="no documents found"):
    prepare.prepare(text_opts(out, [src]))
  assert not {dataset.STATS, dataset.TOKENIZER, dataset.METADATA} & set(os.listdir(out))
  text_file(src, n=500)
  stats = prepare.prepare(text_opts(out, [src]))
  assert stats["documents_kept"] == 500
  assert dataset.DatasetMeta.load(str(out)).verify() == []


# ----------------------------------------------------------------------------- case 7: splits
@pytest.mark.parametrize("value", ["0", "0.999999", "-0.1", "1", "nan", "0.0000001"])
def test_val_fraction_is_checked_where_parsed(tmp_path, value):
  r = cli("prepare_text.py", "--input", text_file(tmp_path / "c.jsonl"), "--output",
          tmp_path / "out", "--val-fraction", value)
  assert "--val-fraction" in one_line(r) and "1e-06..0.5" in r.stderr, r.stderr
  assert not (tmp_path / "out").exists()
  with pytest.raises(prepare.PrepareError, match="--val-fraction"):
    prepare.prepare(text_opts(tmp_path / "o2", [tmp_path / "c.jsonl"],
                              val_fraction=float(value)))


@pytest.mark.parametrize("existing", [False, True])
def test_a_split_without_sequences_is_an_error_not_a_dataset_and_what_it_says_is_true(
    tmp_path, existing):
  """"nothing was written to DIR" was said while DIR/_work/ stayed (of no use to a rerun:
  another --val-fraction or more input starts afresh)."""
  src = text_file(tmp_path / "c.jsonl", n=50)
  out = tmp_path / "out"
  if existing:
    out.mkdir()  # empty: a directory with files no preparation wrote is refused first
  with pytest.raises(prepare.PrepareError,
                     match=r"split 'validation' would have 0 sequences \(0 of 50 documents.*"
                           rf"larger --val-fraction; nothing was written to {out}"):
    prepare.prepare(text_opts(out, [src], val_fraction=1e-6))
  assert (os.listdir(out) == []) if existing else not out.exists()


# ----------------------------------------------------------------------------- case 8/11: options
@pytest.mark.parametrize("flag,value", [
    ("--shard-size-mb", "inf"), ("--shard-size-mb", "nan"), ("--chunk-mb", "0"),
    ("--workers", "-1"), ("--seq-len", "1e3"), ("--seq-len", "4"), ("--vocab-size", "70000"),
    ("--max-input-bytes", "-5"), ("--tokenizer-sample-mb", "0")])
def test_numeric_options_are_checked_where_parsed(tmp_path, flag, value):
  r = cli("prepare_binary.py", "--input", small_elves(1)[0], "--output", tmp_path / "out",
          flag, value, timeout=60)
  err = one_line(r)
  assert flag in err and repr(value) in err
  assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("field,value", [("shard_size_mb", float("inf")), ("workers", -1),
                                         ("chunk_mb", float("nan")), ("seq_len", 128.5)])
def test_numeric_options_are_checked_by_the_library(tmp_path, field, value):
  with pytest.raises(prepare.PrepareError, match=field.replace("_", "-")):
    prepare.prepare(opts(tmp_path / "out", small_elves(1), **{field: value}))


def test_a_vocabulary_below_what_the_tokenizer_makes_is_refused_naming_the_smallest(tmp_path):
  """--vocab-size 7 silently made a 55-token vocabulary (the specials and the corpus's
  alphabet, which a WordPiece trainer always keeps); the smallest it names is one that works."""
  src = text_file(tmp_path / "c.jsonl")
  args = ["--input", src, "--output", tmp_path / "out", "--workers", 1, "--no-progress"]
  err = one_line(cli("prepare_text.py", *args, "--vocab-size", 7))
  smallest = int(re.search(r"--vocab-size 7: a wordpiece tokenizer of this corpus has at least "
                           r"(\d+) tokens \(6 special tokens and its alphabet\); rerun with "
                           r"--vocab-size \1 or more and --overwrite$", err).group(1))
  r = cli("prepare_text.py", *args, "--vocab-size", smallest, "--overwrite")
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout)["vocab_size"] == smallest


def test_a_bpe_vocabulary_below_its_256_bytes_is_refused_before_any_work(tmp_path):
  err = one_line(cli("prepare_text.py", "--input", text_file(tmp_path / "c.jsonl"), "--output",
                     tmp_path / "out", "--tokenizer-model", "bpe", "--vocab-size", 100))
  assert "--vocab-size 100: a byte-level BPE has at least 262 tokens (6 special tokens and 256 " \
         "bytes)" in err
  assert not (tmp_path / "out").exists()


def test_full_disk_is_one_line(tmp_path):
  mnt = tmp_path / "small"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    r = cli("prepare_binary.py", *_bin_args(mnt / "out", small_elves(3)[-1]))
    err = one_line(r)
    assert "no space left" in err and "bytes free" in err and str(mnt) in err
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _default_sigint():
  # A suite started in the background of a script inherits SIGINT ignored, and Python then
  # installs no KeyboardInterrupt handler: the tool would never see this test's Ctrl-C (it ran
  # to the end, exit 0, in two background runs of tools/test.sh). A terminal's job has it.
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_exit_130_and_the_rerun_resumes(tmp_path):
  libs = small_elves()
  ref = cli("prepare_binary.py", *_bin_args(tmp_path / "ref", *libs, workers=2))
  assert ref.returncode == 0, ref.stderr
  out = tmp_path / "out"
  args = _bin_args(out, *libs, workers=2)
  proc = _start(args, start_new_session=True,  # its own process group, like a terminal's job
                preexec_fn=_default_sigint)
  resume = _held_after_first_chunk(proc, out)
  os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the tool and its workers
  resume()
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  err = err.strip()
  assert err.count("\n") == 0 and "interrupted" in err and "resume" in err, err
  r = cli("prepare_binary.py", *args)
  assert r.returncode == 0, r.stderr
  assert "input files changed" not in r.stderr
  a, b = json.loads(ref.stdout), json.loads(r.stdout)
  for k in ("functions_seen", "sequences", "tokens", "input_files"):
    assert a[k] == b[k], k
  assert json.load(open(out / dataset.METADATA))["splits"] == \
      json.load(open(tmp_path / "ref" / dataset.METADATA))["splits"]


@pytest.fixture(scope="module")
def two_worker_dataset(tmp_path_factory):
  """A clean run of what the kill tests below interrupt."""
  out = tmp_path_factory.mktemp("clean") / "ds"
  r = cli("prepare_binary.py", *_bin_args(out, *small_elves(), workers=2))
  assert r.returncode == 0, r.stderr
  return out


SENDS = {"kill -9": lambda pid: os.kill(pid, signal.SIGKILL),
         "SIGTERM": lambda pid: os.kill(pid, signal.SIGTERM),
         "SIGTERM to its group (timeout, systemd)": lambda pid: os.killpg(pid, signal.SIGTERM)}


@pytest.mark.parametrize("how", list(SENDS))
def test_a_run_killed_or_terminated_leaves_no_process_and_the_rerun_is_byte_identical(
    tmp_path, two_worker_dataset, how):
  """Two workers on real ELF files, ended mid-extraction: within seconds no process of the run
  is left (its spawned worker and multiprocessing's resource tracker lived on under ppid 1,
  forever), a SIGTERM is one line and exit 143 (was no line), and the same command then
  finishes the dataset a clean run writes, byte for byte."""
  out = tmp_path / "out"
  args = _bin_args(out, *small_elves(), workers=2)
  proc = _start(args, start_new_session=True)  # its group: what the run started, and only that
  try:
    resume = _held_after_first_chunk(proc, out)
    assert len(alive_in_group(proc.pid)) >= 3  # the tool, its worker, the resource tracker
    SENDS[how](proc.pid)
    resume()
    _, err = proc.communicate(timeout=60)
    assert wait_until_gone(proc.pid) == []
  finally:
    kill_group(proc.pid)
  if how == "kill -9":
    assert proc.returncode == -signal.SIGKILL
  else:
    assert proc.returncode == 128 + signal.SIGTERM, err
    err = err.strip()
    assert err.count("\n") == 0 and err.startswith("error: terminated (SIGTERM); rerun the "
                                                   "same command to resume"), err
  assert not (out / dataset.METADATA).exists()
  r = cli("prepare_binary.py", *args)
  assert r.returncode == 0, r.stderr
  assert "input files changed" not in r.stderr
  _same_output(two_worker_dataset, out)


def test_a_second_preparation_into_one_output_is_refused_naming_the_first(
    tmp_path, two_worker_dataset):
  """The second used to die in a traceback on the first's _work/ files, and with --overwrite
  both did, leaving no dataset. Now it is one line naming the first (its pid and host) and the
  fix, and touches nothing: the first, held still meanwhile, ends with the clean dataset."""
  out = tmp_path / "out"
  args = _bin_args(out, *small_elves(), workers=2)
  first = _start(args, start_new_session=True)
  try:
    resume = _held_after_first_chunk(first, out)  # mid-run, for as long as the second tries
    for extra in ([], ["--overwrite"]):
      err = one_line(cli("prepare_binary.py", *args, *extra))
      assert f"output {str(out)!r} is in use by a single-node preparation (pid {first.pid} on " \
             f"host {socket.gethostname()}, since " in err and "choose another --output" in err
    resume()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
  finally:
    kill_group(first.pid)
  _same_output(two_worker_dataset, out)
  assert not (out / output_dir.LOCK).exists()  # an exclusive holder removes it as it ends


def test_a_refused_run_leaves_no_directory_and_no_lock_behind(tmp_path):
  out = tmp_path / "new"
  with pytest.raises(prepare.PrepareError, match="no ELF files found"):
    prepare.prepare(opts(out, [str(text_file(tmp_path / "c.txt"))]))
  assert not out.exists()
  out.mkdir()
  (out / "thesis.tex").write_text("years of work\n")
  with pytest.raises(prepare.PrepareError, match="not empty: it holds 'thesis.tex'"):
    prepare.prepare(opts(out, small_elves(1)))
  assert os.listdir(out) == ["thesis.tex"]


def test_an_output_that_is_a_file_is_one_line_and_the_file_is_kept(tmp_path):
  out = tmp_path / "notes.txt"
  out.write_text("not a dataset\n")
  err = one_line(cli("prepare_binary.py", "--input", small_elves(1)[0], "--output", out,
                     "--seq-len", SEQ))
  assert f"output {str(out)!r} exists and is not a directory" in err
  assert out.read_text() == "not a dataset\n"


def test_more_workers_than_cpus_run_as_many_as_the_cpus_with_one_warning(tmp_path):
  """--workers 1000 on 2 cores spawned 999 interpreters (54 s for a 2 s job); here 64 on the
  one CPU the process may use (its affinity, as taskset or a container's cpuset gives)."""
  cpu = min(os.sched_getaffinity(0))
  argv = _bin_args(tmp_path / "out", small_elves(1)[0], workers=64)
  argv[argv.index("--vocab-size") + 1] = 300  # one file gives ~390 tokens: no smaller-vocab line
  r = cli("prepare_binary.py", *argv, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
          timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stderr == ("--workers 64: this process may use 1 CPU, so 1 worker run (the output "
                      "is the same for any number)\n")
  assert json.loads(r.stdout)["workers"] == 1


def test_a_ctrl_c_while_a_task_is_submitted_is_not_lost_and_a_worker_spawned_then_ignores_it():
  """Submits may spawn workers, so SIGINT and SIGTERM are blocked meanwhile: a process started
  then keeps them blocked until it ignores them (no traceback per worker, no worker dead of a
  SIGTERM only the parent should act on), and the parent's Ctrl-C is never lost (it comes at
  once through another thread, or as the block ends). Ignoring it instead lost it: a
  full-suite run's Ctrl-C landed on a submit and the tool ran on to exit 0."""
  from lmscale_jax.prep import worker_pool

  show_mask = ("import signal; print(sorted(int(s) for s in signal.pthread_sigmask("
               "signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}))")
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      with worker_pool._signals_blocked():
        child = subprocess.run([sys.executable, "-c", show_mask], capture_output=True,
                               text=True, timeout=60)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert child.stdout.strip() == f"{[int(signal.SIGINT), int(signal.SIGTERM)]}", child.stderr
  finally:
    signal.signal(signal.SIGINT, old)


def test_a_line_longer_than_the_bound_is_an_error_naming_file_and_line(tmp_path):
  src = tmp_path / "one.txt"
  with open(src, "wb") as f:
    f.write(b"short first line\n")
    block = b"word " * (1 << 18)  # 1.25 MiB
    for _ in range(-(-(text_corpus.MAX_DOC_BYTES + 1) // len(block))):
      f.write(block)
  with pytest.raises(prepare.PrepareError,
                     match=r"one.txt:2: line longer than 16 MiB \(from byte 17\)"):
    prepare.prepare(text_opts(tmp_path / "out", [src]))


# ----------------------------------------------------------------------------- inspect_shards
@pytest.fixture(scope="module")
def small_text_dataset(tmp_path_factory):
  d = tmp_path_factory.mktemp("txt")
  out = d / "ds"
  prepare.prepare(text_opts(out, [text_file(d / "c.jsonl", n=1500)], shard_size_mb=0.05))
  return out


@pytest.mark.parametrize("damage,message", [
    ("rename_shard", "missing or unreadable"),
    ("no_tokenizer", "tokenizer.json: missing"),
    ("zero_train_shards", "zero shards"),
])
def test_inspect_show_on_a_damaged_dataset_is_one_line(small_text_dataset, tmp_path, damage,
                                                       message):
  d = tmp_path / "ds"
  shutil.copytree(small_text_dataset, d)
  meta = json.load(open(d / dataset.METADATA))
  if damage == "rename_shard":
    first = d / meta["splits"]["train"]["shards"][0]["file"]
    first.rename(str(first) + ".bak")
  elif damage == "no_tokenizer":
    (d / dataset.TOKENIZER).unlink()
  else:
    meta["splits"]["train"] = {"records": 0, "shards": []}
    (d / dataset.METADATA).write_text(json.dumps(meta))
  r = cli("inspect_shards.py", d, "--show", 3)
  assert message in one_line(r)


# ----------------------------------------------------------------------------- case 9/11: inputs
@pytest.mark.parametrize("kind,message", [("dir", "is a directory"),
                                          ("fifo", "is a FIFO (named pipe)"),
                                          ("zero", "is a character device")])
def test_prepare_text_says_what_a_non_file_input_is(tmp_path, kind, message):
  p = {"dir": tmp_path / "corpus", "fifo": tmp_path / "pipe.jsonl", "zero": "/dev/zero"}[kind]
  if kind == "dir":
    p.mkdir()
  if kind == "fifo":
    os.mkfifo(p)
  r = cli("prepare_text.py", "--input", p, "--output", tmp_path / "out", timeout=60)
  err = one_line(r)
  assert message in err and "expected a regular .txt or .jsonl file" in err and str(p) in err


def test_bad_utf8_names_file_line_and_file_offset(tmp_path):
  src = tmp_path / "c.txt"
  head = "".join(f"line number {i:05d} of a long enough text file\n" for i in range(1, 3001))
  src.write_bytes(head.encode() + b"ok then \xff broken\n")
  offset = len(head.encode()) + len(b"ok then ")
  with pytest.raises(prepare.PrepareError,
                     match=rf"c.txt:3001: not UTF-8 text \(.* at byte {offset} of the file\)"):
    prepare.prepare(text_opts(tmp_path / "out", [src]))


@pytest.mark.parametrize("line,says", [
    ('{"text": "a \\ud800 b"}', r"lone surrogate \(\\ud800"),
    ('{"text": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"text": "\\udfff"}', r"lone surrogate \(\\udfff"),
])
def test_valid_json_that_is_no_text_is_one_line_naming_file_and_line(tmp_path, line, says):
  """Valid JSON all the same: a lone surrogate escape is no character (encoding it raised in a
  worker), and 100,000 levels exceed Python's parser (a RecursionError): both were tracebacks.
  Like a malformed line, the run stops at the line (a document is never silently dropped)."""
  src = text_file(tmp_path / "c.jsonl", n=300)
  with open(src, "a") as f:
    f.write('{"text": "a \\ud83d\\ude00 pair is one character"}\n' + line + "\n")
  r = cli("prepare_text.py", "--input", src, "--output", tmp_path / "out", "--vocab-size", 300,
          "--workers", 1, "--no-progress", timeout=120)
  assert re.search(rf"^error: {re.escape(str(src))}:302: .*{says}", one_line(r)), r.stderr


@pytest.mark.parametrize("content", ["[" * 100_000 + "]" * 100_000, '{"version": "\\ud800"}',
                                     '{"model": {}}'])
def test_a_given_tokenizer_that_is_none_is_refused_before_any_work(tmp_path, content):
  # It was read after pass 1 (the extraction: hours on a large corpus), then refused.
  (tmp_path / "tok.json").write_text(content)
  with pytest.raises(prepare.PrepareError, match=r"--tokenizer .*tok.json: not a Hugging Face"):
    prepare.prepare(text_opts(tmp_path / "out", [text_file(tmp_path / "c.jsonl")],
                              tokenizer=str(tmp_path / "tok.json")))
  assert not (tmp_path / "out").exists()


def test_prepare_binary_counts_named_non_regular_inputs(tmp_path, capfd):
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  d = tmp_path / "dir"
  d.mkdir()
  os.mkfifo(d / "inner_pipe")
  stats = prepare.prepare(opts(tmp_path / "out", [*small_elves(2), str(fifo), "/dev/zero",
                                                  str(d)], workers=1))
  assert stats["files_skipped"].get("not_regular") == 3
  err = capfd.readouterr().err
  assert f"input {str(fifo)!r} is a FIFO (named pipe), not a regular file" in err
  assert "input '/dev/zero' is a character device" in err
  assert stats["workers"] == 1 and stats["mb_per_s_per_core"] > 0


# ----------------------------------------------------------------------------- case 10: --help
SCRIPTS = ["tools/bench_gpu.sh", "tools/demo.sh", "tools/fetch_gpu_wheels.sh", "tools/setup.sh",
           "tools/test.sh", "tools/repeat_tests.sh", "launch/local.sh", "launch/node.sh",
           "launch/slurm.sbatch", "launch/prepare.sbatch", "launch/index.sbatch"]


def _sandbox(tmp_path):
  """A copy of the scripts in an empty tree: whatever one did instead of answering --help
  would happen here (and fail fast: no python, no pip), not in the checkout."""
  box = tmp_path / "box"
  for s in SCRIPTS + ["launch/_procs.sh", "tools/_no_arguments.sh"]:
    (box / s).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, s), box / s)
  env = dict(os.environ, PYTHON="/bin/false", PIP="/bin/false", BENCH_WORK=str(tmp_path / "w"),
             PATH="/usr/bin:/bin")
  return box, env


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_shell_tools_answer_help_and_do_nothing_else(tmp_path, script, flag):
  # Never run a script that has no --help answer: it would do its work (bench_gpu.sh once
  # took "--help" for OUTDIR and, failing to cd there, wrote its results under /).
  text = open(os.path.join(ROOT, script)).read()
  assert any(answer in text for answer in ("-h|--help)", '"${1:-}" == --help',
                                           "_no_arguments.sh")), f"{script}: no --help"
  box, env = _sandbox(tmp_path)
  before = tree(box)
  r = subprocess.run(["bash", str(box / script), flag], capture_output=True, text=True,
                     timeout=30, env=env, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  first = open(os.path.join(ROOT, script)).readlines()[1].lstrip("# ").strip()
  assert r.stdout.startswith(first), r.stdout[:300]
  assert tree(box) == before and not (tmp_path / "w").exists()


@pytest.mark.parametrize("script", ["tools/bench_gpu.sh", "tools/demo.sh",
                                    "tools/fetch_gpu_wheels.sh", "tools/setup.sh"])
def test_shell_tools_refuse_an_unknown_option_in_one_line(tmp_path, script):
  text = open(os.path.join(ROOT, script)).read()
  assert "unknown" in text or "_no_arguments.sh" in text, f"{script}: takes any option"
  box, env = _sandbox(tmp_path)
  before = tree(box)
  r = subprocess.run(["bash", str(box / script), "--frobnicate"], capture_output=True,
                     text=True, timeout=30, env=env, cwd=tmp_path)
  assert r.returncode == 1 and "--frobnicate" in one_line(r, code=1)
  assert tree(box) == before


@pytest.mark.parametrize("tool", ["prepare_binary.py", "prepare_text.py", "inspect_shards.py"])
def test_python_tools_answer_help(tool):
  r = cli(tool, "--help", timeout=60)
  assert r.returncode == 0 and r.stdout.startswith("usage:") and not r.stderr


def test_bench_gpu_refuses_an_outdir_it_cannot_create(tmp_path):
  # Checked first: the unfixed script went on with OUT="" and wrote its results under /.
  assert "cannot create OUTDIR" in open(os.path.join(ROOT, "tools/bench_gpu.sh")).read()
  box, env = _sandbox(tmp_path)
  (tmp_path / "file").write_text("")
  r = subprocess.run(["bash", str(box / "tools/bench_gpu.sh"), str(tmp_path / "file" / "out")],
                     capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
  assert "cannot create OUTDIR" in one_line(r, code=1)
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("tool, args", [
    ("build_similarity_bench.py", ["--sources", "src"]),
    ("embed.py", ["--workdir", "run"]),
    ("import_hf.py", ["--hf", "hf", "--data", "data"]),
    ("sweep.py", [])])
def test_a_file_output_in_a_missing_directory_is_refused_before_any_work(tmp_path, tool, args):
  # build_similarity_bench compiled for 34 s, then died in a traceback on the missing directory.
  out = tmp_path / "missing" / "out.file"
  err = one_line(cli(tool, *args, "--output", out, timeout=60, cwd=tmp_path))
  assert f"directory {str(out.parent)!r} does not exist" in err
  err = one_line(cli(tool, *args, "--output", tmp_path, timeout=60, cwd=tmp_path))
  assert "is a directory" in err
  assert sorted(os.listdir(tmp_path)) == []
