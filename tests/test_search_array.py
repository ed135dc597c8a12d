"""lmscale index at scale, on real parts (tests/test_search_index.py's binaries and short run):
the index as a Slurm job array (launch/index.sbatch under a fake sbatch that runs each array
task as its own process) against the one-node index, byte for byte; a task's rerun and a finish
with tasks missing; embedding data-parallel on 4 host devices against 1; and the index's bad
inputs, each one line, with nothing indexed before them lost."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lmscale_jax.inference import function_vectors, trained_model
from lmscale_jax.search import index, index_array, index_files, query
from tests.helpers import ROOT
from tests.test_hf_tools import run, run_tool  # noqa: F401 (fixtures)
from tests.test_prepare_cluster import FAKE_SBATCH
from tests.test_search_index import binaries, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
SBATCH = os.path.join(ROOT, "launch", "index.sbatch")


@pytest.fixture(scope="module")
def paths(binaries):
  """Six binaries and a duplicate of the first (de-duplicated by sha256: indexed once)."""
  return binaries["O0"] + binaries["O2"] + [binaries["O0"][0]]


@pytest.fixture(scope="module")
def one_node(model, paths, tmp_path_factory):
  where = tmp_path_factory.mktemp("one") / "idx"
  index.build(model, paths, str(where), say=lambda _: None)
  return where


def assert_same_index(a, b):
  """index.json and every shard file byte for byte; no parts/ or temp file left."""
  assert filecmp.cmp(a / "index.json", b / "index.json", shallow=False)
  assert sorted(os.listdir(a / "shards")) == sorted(os.listdir(b / "shards"))
  for name in os.listdir(a / "shards"):
    assert filecmp.cmp(a / "shards" / name, b / "shards" / name, shallow=False), name
  assert sorted(os.listdir(b)) == ["index.json", "shards"]


def fake_slurm(tmp_path) -> tuple[dict, object]:
  bin_dir = tmp_path / "slurm" / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "sbatch").write_text(FAKE_SBATCH)
  os.chmod(bin_dir / "sbatch", 0o755)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "INDEX_"))}
  env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SLURM=str(bin_dir.parent),
             SLURM_SUBMIT_DIR=ROOT, PYTHON=sys.executable, INDEX_TASKS="3", JAX_PLATFORMS="cpu")
  return env, bin_dir.parent


def test_a_3_task_array_then_finish_writes_the_one_node_index_byte_for_byte(run, paths,
                                                                           one_node, tmp_path):
  """launch/index.sbatch: 3 array tasks (3 processes at once, Slurm's array variables) and the
  finish job after them; the ELF paths from an --elf-list file."""
  env, slurm = fake_slurm(tmp_path)
  (tmp_path / "elves.txt").write_text("\n".join(paths) + "\n")
  out = tmp_path / "array"
  r = subprocess.run(["bash", SBATCH, "--workdir", str(run[1]), "--elf-list",
                      str(tmp_path / "elves.txt"), "--output", str(out)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  logs = "".join(p.read_text() for p in sorted(slurm.glob("job-*.log")))
  assert r.returncode == 0 and "submitted: index 101 (3 tasks) → finish 102" in r.stdout, \
      r.stderr + logs
  calls = (slurm / "calls.log").read_text().splitlines()
  assert "--array=0-2" in calls[0] and "--dependency=afterok:101" in calls[1], calls
  assert not (slurm / "failed").exists(), logs
  assert "task 2 of 3 embedded 2 binaries" in logs and "added 6 binaries" in logs, logs
  assert_same_index(one_node, out)


def test_the_sbatch_script_answers_help_checks_its_arguments_and_runs_one_job(run, binaries,
                                                                              tmp_path):
  """bash -n; --help prints its header and does nothing else; no --output or a bad INDEX_TASKS
  is one line; INDEX_TASKS=1 submits one plain lmscale index job (no finish)."""
  assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0
  env, slurm = fake_slurm(tmp_path)
  r = subprocess.run(["bash", SBATCH, "--help"], env=dict(env, PYTHON="/bin/false"),
                     cwd=tmp_path, capture_output=True, text=True, timeout=30)
  assert r.returncode == 0 and r.stdout.startswith("A function index on a Slurm cluster")
  assert "lmscale index finish --output INDEX_DIR" in r.stdout
  assert not (slurm / "calls.log").exists()
  for extra, argv, message in (
      ({}, ["--workdir", run[1], "--elf", binaries["O0"][0]], "error: give --output INDEX_DIR"),
      ({"INDEX_TASKS": "0"}, ["--output", tmp_path / "i"], "error: INDEX_TASKS=0: expected a")):
    r = subprocess.run(["bash", SBATCH, *map(str, argv)], env=dict(env, **extra), cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith(message), r.stderr
  out = tmp_path / "plain"
  r = subprocess.run(["bash", SBATCH, "--workdir", str(run[1]), "--elf", binaries["O0"][0],
                      "--output", str(out)], env=dict(env, INDEX_TASKS="1"), cwd=ROOT,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and "submitted: index 101 (one job)" in r.stdout, r.stderr
  calls = (slurm / "calls.log").read_text().splitlines()
  assert len(calls) == 1 and "--array" not in calls[0], calls
  doc = json.loads((out / "index.json").read_text())
  assert [b["path"] for b in doc["binaries"]] == [binaries["O0"][0]]


def test_a_rerun_task_redoes_only_what_lacks_a_marker(model, paths, one_node, tmp_path):
  where, said = tmp_path / "idx", []
  index_array.run_task(model, paths, str(where), 0, 2, say=said.append)
  parts = where / index_array.PARTS
  task0 = parts / index_array.task_name(0, 2)
  mine = json.loads(task0.read_text())["binaries"]
  assert [b["path"] for b in mine] == paths[:3] and not (where / "index.json").exists()
  kept = {n: os.stat(where / "shards" / n).st_mtime_ns for n in os.listdir(where / "shards")}
  lost = mine[1]  # its marker and the task's file gone: a task killed after its first binary
  os.unlink(parts / f"binary-{lost['sha256']}.json"), os.unlink(task0)
  gone = mine[2]  # its marker kept but a shard file lost: embedded again too
  os.unlink(where / (gone["shard"] + ".npz"))
  del kept[f"{gone['sha256']}.npz"]
  with pytest.raises(Exception, match=r"parts: no task files \(run the array's tasks first"):
    index_array.finish(str(where))
  said.clear()
  index_array.run_task(model, paths, str(where), 0, 2, say=said.append)
  assert said == [f"already embedded: {paths[0]}", f"indexed {lost['functions']} functions of "
                  f"{paths[1]}", f"indexed {gone['functions']} functions of {paths[2]}"]
  for name, mtime in kept.items():
    redone = lost["sha256"] in name or gone["sha256"] in name
    assert (os.stat(where / "shards" / name).st_mtime_ns == mtime) != redone, name
  with pytest.raises(Exception, match=r"task\(s\) 1 of 2 have not finished \(no parts/task-"
                     r"00001-of-00002.json\)"):
    index_array.finish(str(where))
  index_array.run_task(model, paths, str(where), 1, 2, say=said.append)
  assert index_array.finish(str(where)) == {
      "added": 6, "functions": sum(len(index.elf_functions_of(p)) for p in paths[:6]),
      "files_skipped": {}}
  assert_same_index(one_node, where)


def test_an_index_over_the_exact_size_gets_its_search_graph_once(model, run, paths, tmp_path,
                                                                capsys, monkeypatch):
  """vector_search.EXACT_MAX (rows; measured: 100,000) set to 0 here, so these few
  functions are "over" it: lmscale index and an array's finish keep the HNSW graph."""
  from lmscale_jax.search import vector_search

  monkeypatch.setattr(vector_search, "EXACT_MAX", 0)
  functions = sum(len(index.elf_functions_of(p)) for p in paths[:6])
  code, text, err = run_tool("index", ["--workdir", run[1], "--elf", *paths, "--output",
                                       tmp_path / "one"], capsys)
  assert code == 0 and f"search graph of {functions} functions kept" in text, err
  for i in range(2):
    index_array.run_task(model, paths, str(tmp_path / "two"), i, 2, say=lambda _: None)
  code, text, err = run_tool("index", ["finish", "--output", tmp_path / "two"], capsys)
  assert code == 0 and f"search graph of {functions} functions kept" in text, err
  for where in ("one", "two"):
    kept = json.loads((tmp_path / where / vector_search.ANN_DIR /
                       vector_search.GRAPH_META).read_text())
    assert kept["rows"] == functions and kept["recall_at_10"] >= 0.99, kept


FOUR_DEVICES = r"""
import json, sys
import jax, numpy as np
from lmscale_jax.inference import function_vectors, trained_model
workdir, texts_file, out = sys.argv[1:]
model = trained_model.load(workdir=workdir)
texts = json.load(open(texts_file))
inputs = [(f"f{i}", "", *trained_model.encode(model, t)) for i, t in enumerate(texts)]
where = function_vectors.mesh()
assert jax.local_device_count() == 4 and where.devices.size == 4
rows = jax.device_put(np.zeros((4 * function_vectors.BATCH, model.cfg.seq_len), np.int32),
                      jax.sharding.NamedSharding(where, jax.sharding.PartitionSpec("batch")))
placed = function_vectors.on_devices(model, where)
h = trained_model._hidden_fn(model.cfg.to_json())(placed.params, rows)
per_device = sorted({s.data.shape[0] for s in h.addressable_shards})
print(json.dumps({"shards": len(h.addressable_shards), "rows": per_device}))
got = {"mean": function_vectors.embed(model, inputs)["embeddings"],
       "cls": function_vectors.embed(model, inputs, "cls")["embeddings"]}
rng = np.random.default_rng(0)
head = {"pool": "mean", "projection": {
    "kernel": rng.normal(size=(model.cfg.hidden, 16)).astype(np.float32),
    "bias": np.zeros(16, np.float32)}}
np.save(out + ".head.npy", head["projection"]["kernel"])
import dataclasses
tuned = dataclasses.replace(model, head=head)
got["head"] = function_vectors.embed(tuned, inputs)["embeddings"]
np.savez(out, **got)
"""


def test_embedding_on_four_host_devices_equals_one_device(run, model, binaries, tmp_path):
  """The batch's rows split 32 per device over 4 host devices (XLA_FLAGS), two batches the
  second padded, mean, [CLS] and a projection head: the vectors of one device within 1e-6."""
  import dataclasses

  import jax

  fns = [f for p in binaries["O0"] + binaries["O2"] for f in index.elf_functions_of(p)]
  texts = [" [NEXT] ".join(f.instructions[:k]) for f in fns for k in range(1, 12)][:200]
  assert len(texts) > 4 * function_vectors.BATCH
  (tmp_path / "texts.json").write_text(json.dumps(texts))
  (tmp_path / "script.py").write_text(FOUR_DEVICES)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  r = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(run[1]),
                      str(tmp_path / "texts.json"), str(tmp_path / "four.npz")], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.splitlines()[-1]) == {"shards": 4, "rows": [32]}
  assert jax.local_device_count() == 1
  inputs = [(f"f{i}", "", *trained_model.encode(model, t)) for i, t in enumerate(texts)]
  kernel = np.load(tmp_path / "four.npz.head.npy")
  tuned = dataclasses.replace(model, head={"pool": "mean", "projection": {
      "kernel": kernel, "bias": np.zeros(kernel.shape[1], np.float32)}})
  one = {"mean": function_vectors.embed(model, inputs)["embeddings"],
         "cls": function_vectors.embed(model, inputs, "cls")["embeddings"],
         "head": function_vectors.embed(tuned, inputs)["embeddings"]}
  four = np.load(tmp_path / "four.npz")
  for pool, vectors in one.items():
    diff = float(np.abs(vectors - four[pool]).max())
    print(f"{pool}: largest difference 4 devices vs 1: {diff:.1e}")
    assert vectors.shape == (len(texts), vectors.shape[1]) and diff < 1e-6, (pool, diff)


def test_length_buckets_give_seq_len_paddings_vectors_in_the_input_order(model, binaries,
                                                                          monkeypatch):
  """Sorted by length inside each window and padded to the batch's bucket: more than one
  window, a short last batch, functions cut at seq_len among them; mean, [CLS] and a projection
  head within 1e-5 of padding every batch to seq_len (BUCKETS = 1), row for row."""
  import dataclasses

  fns = [f for p in binaries["O0"] + binaries["O2"] for f in index.elf_functions_of(p)]
  texts = [" [NEXT] ".join(f.instructions[:k]) for f in fns for k in (*range(1, 60, 4), 400)]
  texts = [texts[i] for i in np.random.default_rng(0).permutation(len(texts))][:300]
  assert len(texts) > function_vectors.WINDOW * function_vectors.BATCH
  inputs = [(f"f{i}", "", *trained_model.encode(model, t)) for i, t in enumerate(texts)]
  assert any(cut for *_, cut in inputs) and not all(cut for *_, cut in inputs)
  rng = np.random.default_rng(1)
  tuned = dataclasses.replace(model, head={"pool": "mean", "projection": {
      "kernel": rng.normal(size=(model.cfg.hidden, 16)).astype(np.float32),
      "bias": np.zeros(16, np.float32)}})
  shapes, forward = [], function_vectors.forward
  monkeypatch.setattr(function_vectors, "forward",
                      lambda m, ids, w: shapes.append(ids.shape[1]) or forward(m, ids, w))

  def vectors():
    return {"mean": function_vectors.embed(model, inputs)["embeddings"],
            "cls": function_vectors.embed(model, inputs, "cls")["embeddings"],
            "head": function_vectors.embed(tuned, inputs)["embeddings"]}

  bucketed = vectors()
  assert min(shapes) < model.cfg.seq_len and len(set(shapes)) > 2, sorted(set(shapes))
  monkeypatch.setattr(function_vectors, "BUCKETS", 1)
  shapes.clear()
  padded = vectors()
  assert set(shapes) == {model.cfg.seq_len}
  for pool, v in padded.items():
    diff = float(np.abs(bucketed[pool] - v).max())
    print(f"{pool}: largest difference buckets vs seq_len padding: {diff:.1e}")
    assert bucketed[pool].shape == v.shape == (len(texts), v.shape[1]) and diff < 1e-5, diff


# --------------------------------------------------------------------------- bad input
def one_line(name, argv, capsys, message):
  code, out, err = run_tool(name, argv, capsys)
  assert code == 1 and len(err.strip().splitlines()) == 1 and message in err, (argv, out, err)
  return err


def test_bad_files_are_one_line_before_anything_is_written(run, binaries, tmp_path, capsys):
  good, model_args = binaries["O0"], ["--workdir", run[1]]
  notes = tmp_path / "notes.txt"
  notes.write_text("not a binary\n")
  arm = tmp_path / "arm.so"
  data = bytearray(open(good[0], "rb").read())
  data[18:20] = (183).to_bytes(2, "little")  # e_machine = EM_AARCH64
  arm.write_bytes(bytes(data))
  cut = tmp_path / "cut.so"
  cut.write_bytes(bytes(data[:40]))
  for bad, message in ((notes, f"{notes}: not an ELF file"),
                       (arm, f"{arm}: machine AArch64; the model reads x86-64 code"),
                       (cut, f"{cut}: unreadable ELF file")):
    for tasks in (["--tasks", 1], ["--task", 1, "--tasks", 2]):
      out = tmp_path / f"never-{bad.name}-{len(tasks)}"
      one_line("index", [*model_args, "--elf", good[0], good[1], bad, "--output", out, *tasks,
                         "--strict"], capsys, message)
      assert not out.exists()  # the good files before it were not embedded either
  one_line("index", [*model_args, "--elf", good[0], "--output", tmp_path / "x", "--task", 3,
                     "--tasks", 3], capsys, "--task 3: expected 0 .. 2 (--tasks 3)")
  one_line("index", ["finish", "--output", tmp_path / "x"], capsys, "no task files")
  (tmp_path / "list.txt").write_text(f"{good[0]}\n\n{tmp_path / 'gone.so'}\n")
  one_line("index", [*model_args, "--elf-list", tmp_path / "list.txt", "--output",
                     tmp_path / "x"], capsys, f"list.txt: '{tmp_path / 'gone.so'}': no such file")
  assert not (tmp_path / "x").exists()


def test_a_binary_that_fails_midway_keeps_the_ones_before_it(model, run, binaries, tmp_path,
                                                             capsys):
  """An x86-64 object with no function (its header passes): found only once it is read."""
  (tmp_path / "data.c").write_text("int table[4] = {1, 2, 3, 4};\n")
  no_code = tmp_path / "data.o"
  subprocess.run(["gcc", "-c", "-o", str(no_code), str(tmp_path / "data.c")], check=True)
  good, out = binaries["O0"], tmp_path / "idx"
  err = one_line("index", ["--workdir", run[1], "--elf", good[0], no_code, good[1], "--output",
                           out, "--strict"], capsys, f"{no_code}: no named x86-64 functions")
  assert f"(1 binaries before it are in {out}; rerun without it" in err
  doc = json.loads((out / "index.json").read_text())
  assert [b["path"] for b in doc["binaries"]] == [good[0]]
  code, text, err = run_tool("index", ["--workdir", run[1], "--elf", good[0], good[1],
                                       "--output", out], capsys)
  assert code == 0 and "added 1 binaries" in text and "1 already indexed" in text, err


def damaged(one_node, tmp_path, name, damage):
  """A copy of the one-node index with ``damage(dir, first binary's entry)`` done to it."""
  where = tmp_path / name
  shutil.copytree(one_node, where)
  first = json.loads((where / "index.json").read_text())["binaries"][0]
  damage(where, first)
  return where, first


def test_a_damaged_index_is_one_line_naming_the_file_and_the_fix(model, run, paths, one_node,
                                                                 tmp_path, capsys):
  def truncate(where, _):
    text = (where / "index.json").read_text()
    (where / "index.json").write_text(text[:len(text) // 2])

  def garble_npz(where, first):
    (where / (first["shard"] + ".npz")).write_bytes(b"PK\x03\x04 not a zip file")

  def drop_row(where, first):
    rows = (where / (first["shard"] + ".jsonl")).read_text().splitlines(keepends=True)
    (where / (first["shard"] + ".jsonl")).write_text("".join(rows[1:]))

  def foreign_shard(where, first):
    doc = json.loads((where / "index.json").read_text())
    doc["binaries"][0]["shard"] = "../../elsewhere"  # a reader opens only shards/<sha256>
    (where / "index.json").write_text(json.dumps(doc))

  def drop_shard(where, first):
    os.unlink(where / (first["shard"] + ".npz"))

  search = ["--workdir", run[1], "--text", "push rbp"]
  cases = [(truncate, "index.json: not a JSON file", "delete the index directory and build it"),
           (garble_npz, ".npz: unreadable shard", "rerun lmscale index --output "),
           (drop_row, "rows, index.json expects", "(it rebuilds the damaged shard from "),
           (foreign_shard, "index.json: not an index of format", "build it again")]
  for damage, message, fix in cases:
    where, _ = damaged(one_node, tmp_path, damage.__name__, damage)
    err = one_line("search", ["--index", where, *search], capsys, message)
    assert fix in err, err
  where, first = damaged(one_node, tmp_path, "missing", drop_shard)
  err = one_line("index", ["--workdir", run[1], "--elf", *paths, "--output", where, "--tasks",
                           "2"], capsys, f"{first['shard']}.npz is missing (1 damaged shard(s))")
  assert "without --tasks once to rebuild them" in err  # tests/test_index_repair.py: the rest
  # An entry dropped from index.json by hand: the rerun embeds that binary again.
  where = tmp_path / "drop_row"
  doc = json.loads((where / "index.json").read_text())
  doc["binaries"] = [b for b in doc["binaries"] if b["sha256"] != first["sha256"]]
  (where / "index.json").write_text(json.dumps(doc))
  code, text, err = run_tool("index", ["--workdir", run[1], "--elf", *paths, "--output", where],
                             capsys)
  assert code == 0 and "added 1 binaries" in text, err
  again = query.load(str(where), model)
  assert len(again.vectors) == len(query.load(str(one_node), model).vectors)


def test_finish_over_task_files_of_two_runs_is_one_line(model, paths, tmp_path, capsys):
  where = tmp_path / "idx"
  index_array.run_task(model, paths[:2], str(where), 0, 2, say=lambda _: None)
  index_array.run_task(model, paths[:2], str(where), 1, 3, say=lambda _: None)
  one_line("index", ["finish", "--output", where], capsys, "task files of different runs")
  assert not (where / index_files.INDEX).exists()



def test_measured_passes_time_every_program_and_cut_to_the_same_vectors(model, binaries):
  """lmscale serve's cut (by its programs' measured seconds) against lmscale embed's (by
  positions): every program timed once compiled, and the vectors row for row within 1e-5."""
  where = function_vectors.mesh()
  costs = function_vectors.measured_passes(model, "mean", where, repeats=1)
  seq = int(model.cfg.seq_len)
  lengths = {function_vectors.padded_length(n, seq) for n in range(1, seq + 1)}
  rows = {r * where.devices.size for r in function_vectors.ROW_BUCKETS}
  assert set(costs) == {(r, n) for r in rows for n in lengths}
  assert all(0 < s < 60 for s in costs.values())
  fns = [f for p in binaries["O0"] for f in index.elf_functions_of(p)]
  texts = [" [NEXT] ".join(f.instructions[:k]) for f in fns for k in (1, 9, 30, 400)]
  inputs = [(f"f{i}", "", *trained_model.encode(model, t)) for i, t in enumerate(texts)]
  small = {key: (1.0 if key[0] == min(rows) else 99.0) for key in costs}  # 8 rows always
  by_positions = function_vectors.embed(model, inputs)["embeddings"]
  for table in (costs, small):
    measured = function_vectors.embed(model, inputs, costs=table)["embeddings"]
    assert float(np.abs(measured - by_positions).max()) < 1e-5
