"""Bad input and careless use of the model tools (evaluate, fill_mask, embed, export_hf,
inspect_checkpoint, inspect_shards, eval_similarity, finetune_similarity, …): each case ends in
one `error:` line naming the file and what was expected there, before any work is done, never a
traceback, a hang or a silently wrong answer.

Real parts throughout: a dataset prepared from this machine's libraries, a real 6-step training
run (trained once for the module), damaged copies of its files, FIFOs made with os.mkfifo, and
the tools run as the user runs them, as subprocesses with a timeout (a hang fails the test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from lmscale_jax.exits import EXIT_USAGE
from lmscale_jax.prep import prepare
from lmscale_jax.similarity import function_groups
from lmscale_jax.store import dataset, records
from lmscale_jax.pretrain import trainer as train
from tests.helpers import ROOT, communicate, lmscale, small_train_config
from tests.test_hf_tools import ELF, INPUTS

SOURCES = os.path.join(ROOT, "tests", "data", "similarity")
TIMEOUT = 90  # a tool that fails here does so in seconds; past this it hangs
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def cli(tool: str, *args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
  """The lmscale subcommand ``tool`` (its old tools/ name) as a user runs it; past ``timeout``
  its process group is killed and the test fails (a FIFO read blocks forever)."""
  p = subprocess.Popen([*lmscale(tool), *map(str, args)],
                       cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), text=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, start_new_session=True)
  out, err = communicate(p, timeout)
  return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def one_line(r: subprocess.CompletedProcess, code: int = EXIT_USAGE) -> str:
  """The run's whole stderr: one `error:` line, and exit ``code``."""
  assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
  err = r.stderr.strip()
  assert err.count("\n") == 0 and err.startswith("error: "), err
  return err


def prepared(out, **kw) -> str:
  prepare.prepare(prepare.PrepareOptions(**{**dict(kind="binary", inputs=INPUTS, output=str(out),
                                            seq_len=64, vocab_size=400, val_fraction=0.1,
                                            workers=1, progress=False,
                                            # the exported functions: the data whose shard
                                            # bytes these tests edit at fixed offsets
                                            functions="symbols"), **kw}))
  return str(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(dataset, workdir): two system libraries prepared, and a 6-step run on them."""
  base = tmp_path_factory.mktemp("tools")
  data = prepared(base / "ds")
  train.train_and_evaluate(small_train_config(data), str(base / "run"))
  return data, str(base / "run")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """A similarity benchmark (also a fine-tuning pairs file) built from tests/data/similarity."""
  header, groups = function_groups.build([SOURCES], ["gcc"], ["O0", "O3"], say=print)
  out = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
  function_groups.write(str(out), header, groups)
  return str(out)


def fifo(path) -> str:
  os.mkfifo(path)
  return str(path)


# ----------------------------------------------------------------------------- the dataset's shape
@pytest.mark.parametrize("other", ["vocab_size", "seq_len"])
def test_evaluate_on_a_dataset_of_another_shape_is_one_line(trained, tmp_path, other):
  """Was a 345-line Orbax traceback: the shapes are compared before anything is restored."""
  data, workdir = trained
  kw = ({"vocab_size": 300} if other == "vocab_size" else
        {"seq_len": 32, "tokenizer": os.path.join(data, dataset.TOKENIZER)})
  err = one_line(cli("evaluate.py", "--workdir", workdir, "--data", prepared(tmp_path / "o", **kw)))
  want = {"vocab_size": "vocab_size 300, the model's", "seq_len": "seq_len 32, the model's"}
  assert want[other] in err and workdir in err and "--tokenizer" in err


def test_embed_checks_the_dataset_before_restoring_the_model(trained, tmp_path):
  """The same rule (trained_model.check_dataset), asked before the checkpoint is read: nothing
  but the one line on stderr (Orbax logs its restore)."""
  other = prepared(tmp_path / "o", vocab_size=300)
  err = one_line(cli("embed.py", "--workdir", trained[1], "--data", other, "--output",
                     tmp_path / "e.npz"))
  assert "vocab_size 300, the model's" in err and not (tmp_path / "e.npz").exists()


def _tokens_swapped(data: str, to) -> str:
  """The dataset with the ids of "push" and "rbp" exchanged in its tokenizer: the same
  vocabulary size and shards, another tokenizer (as a dataset prepared from other inputs with
  one --vocab-size)."""
  shutil.copytree(data, to)
  path = to / dataset.TOKENIZER
  tok = json.loads(path.read_text())
  vocab = tok["model"]["vocab"]
  vocab["push"], vocab["rbp"] = vocab["rbp"], vocab["push"]
  path.write_text(json.dumps(tok))
  return str(to)


@pytest.mark.parametrize("tool", ["evaluate", "embed_data", "fill_mask_tokenizer"])
def test_another_tokenizer_of_the_same_size_is_one_line(trained, tmp_path, tool):
  """Was a silent score (or embedding, or prediction) through the wrong token ids: a run is
  bound to its tokenizer's digest (config.json's "dataset"), checked before the restore."""
  data, workdir = trained
  other = _tokens_swapped(data, tmp_path / "other")
  args = {"evaluate": ("evaluate.py", "--workdir", workdir, "--data", other),
          "embed_data": ("embed.py", "--workdir", workdir, "--data", other, "--output",
                         tmp_path / "e.npz"),
          "fill_mask_tokenizer": ("fill_mask.py", "--workdir", workdir, "--tokenizer",
                                  os.path.join(other, dataset.TOKENIZER), "--text",
                                  "push rbp [NEXT] [MASK] rbp rsp")}[tool]
  err = one_line(cli(*args))
  assert "has another tokenizer than the run in" in err and workdir in err, err
  assert "would mean other tokens" in err and not (tmp_path / "e.npz").exists()


def test_the_runs_tokenizer_is_found_from_any_working_directory(trained, tmp_path):
  """data.path as typed was relative: the run's record keeps the dataset's absolute path, so a
  tool started elsewhere reads the run's tokenizer, not whatever that name means there."""
  data, workdir = trained
  run = tmp_path / "run"
  cwd = os.path.dirname(data)
  c = small_train_config(os.path.basename(data), steps=2)
  here = os.getcwd()
  os.chdir(cwd)
  try:
    train.train_and_evaluate(c, str(run))
  finally:
    os.chdir(here)
  assert json.loads((run / "config.json").read_text())["dataset"]["path"] == data
  elsewhere = tmp_path / "elsewhere"
  _tokens_swapped(data, elsewhere / os.path.basename(data))
  answers = []
  for where in (cwd, elsewhere):
    r = subprocess.run([*lmscale("fill_mask"), "--workdir", str(run), "--text",
                        "push rbp [NEXT] [MASK] rbp rsp", "--json"], cwd=where,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    answers.append(json.loads(r.stdout))
  assert answers[0] == answers[1]  # "push" and "rbp" swap ids in the copy elsewhere


# ----------------------------------------------------------------------------- damaged workdirs
def damage(workdir: str, how: str, tmp_path) -> str:
  """A copy of the run with one of its files damaged ``how``."""
  w = shutil.copytree(workdir, tmp_path / "damaged")
  config, metrics = w / "config.json", w / "metrics.jsonl"
  if how == "config_cut_short":
    config.write_bytes(config.read_bytes()[:100])
  elif how in ("config_empty_object", "config_array"):
    config.write_text("{}\n" if how == "config_empty_object" else "[1, 2]\n")
  elif how == "config_directory":
    config.unlink()
    config.mkdir()
  elif how == "config_fifo":
    config.unlink()
    fifo(config)
  elif how == "checkpoints_file":
    shutil.rmtree(w / "checkpoints")
    (w / "checkpoints").write_text("not a directory\n")
  elif how == "metrics_directory":
    metrics.unlink()
    metrics.mkdir()
  elif how == "metrics_bad_line":
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2] + ['{"step": 3, "lo\n', "[3, 4]\n"] + lines[3:]))
  return str(w)


def command(tool: str, workdir: str, trained, pairs, tmp_path) -> list:
  """``tool`` reading ``workdir`` as a user would call it."""
  return {
      "evaluate": ["evaluate.py", "--workdir", workdir, "--data", trained[0]],
      "fill_mask": ["fill_mask.py", "--workdir", workdir, "--text", "push rbp [NEXT] [MASK] rbp"],
      "embed": ["embed.py", "--workdir", workdir, "--elf", ELF, "--output", tmp_path / "e.npz"],
      "export_hf": ["export_hf.py", "--workdir", workdir, "--output", tmp_path / "hf"],
      "inspect_checkpoint": ["inspect_checkpoint.py", workdir],
      "eval_similarity": ["eval_similarity.py", "--bench", pairs, "--workdir", workdir,
                          "--no-random-init"],
      "finetune_similarity": ["finetune_similarity.py", "--pairs", pairs, "--workdir",
                              tmp_path / "ft", "--init-workdir", workdir, "--steps", 2,
                              "--batch-size", 4],
  }[tool]


ALL_TOOLS = ["evaluate", "fill_mask", "embed", "export_hf", "inspect_checkpoint",
             "eval_similarity", "finetune_similarity"]
CONFIG_CUT = "config.json: not valid JSON"
DAMAGE = [
    *[("config_cut_short", tool, CONFIG_CUT) for tool in ALL_TOOLS],
    ("config_empty_object", "inspect_checkpoint", "config.json is not a training run's config"),
    ("config_array", "inspect_checkpoint", "config.json: an array, expected a training run's"),
    ("config_directory", "embed", "config.json is a directory: expected a training run's"),
    ("config_fifo", "export_hf", "config.json is a FIFO: expected a training run's"),
    *[("checkpoints_file", tool, "checkpoints is a file: expected the directory of the run's "
       "checkpoints") for tool in ("evaluate", "export_hf", "inspect_checkpoint")],
    *[("metrics_directory", tool, "metrics.jsonl is a directory: expected the run's metrics")
      for tool in ("export_hf", "inspect_checkpoint")],
    *[("metrics_bad_line", tool, "metrics.jsonl: line 3 is '{\"step\": 3, \"lo': expected one "
       "JSON object per line") for tool in ("export_hf", "inspect_checkpoint")],
]


@needs_gcc
@pytest.mark.parametrize("how,tool,message", DAMAGE, ids=[f"{h}-{t}" for h, t, _ in DAMAGE])
def test_a_damaged_workdir_file_is_one_line_naming_it(trained, pairs, tmp_path, how, tool,
                                                      message):
  """inspect_checkpoint lists what it can and exits 1 (a file it cannot read is a problem of
  the workdir, as a checkpoint that fails --verify is); the others exit EXIT_USAGE (a user
  error)."""
  workdir = damage(trained[1], how, tmp_path)
  code = 1 if tool == "inspect_checkpoint" and how != "checkpoints_file" else EXIT_USAGE
  err = one_line(cli(*command(tool, workdir, trained, pairs, tmp_path)), code)
  assert workdir in err and message in err
  assert not (tmp_path / "hf").exists() and not (tmp_path / "e.npz").exists()
  assert not (tmp_path / "ft").exists()  # a fine-tune with no start model: no workdir either


def test_a_kills_torn_last_metrics_line_and_a_non_finite_loss_still_export(trained, tmp_path):
  """What training itself leaves is no damage: a last line cut by a kill (training drops it
  when it resumes) and null for a non-finite eval loss (train.metrics writes that)."""
  workdir = shutil.copytree(trained[1], tmp_path / "run")
  metrics = workdir / "metrics.jsonl"
  rows = [json.loads(x) for x in metrics.read_text().splitlines()]
  rows[-1]["eval_loss"] = None
  metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')
  r = cli("export_hf.py", "--workdir", workdir, "--output", tmp_path / "hf")
  assert r.returncode == 0, r.stderr[-3000:]
  card = (tmp_path / "hf" / "README.md").read_text()
  assert "| final eval loss | non-finite (MLM accuracy" in card
  r = cli("inspect_checkpoint.py", workdir)
  assert r.returncode == 0 and "eval_loss non-finite" in r.stdout, r.stderr[-3000:]


# ----------------------------------------------------------------------------- output paths
def test_eval_similarity_refuses_an_output_path_before_evaluating(trained, pairs, tmp_path):
  """Was: the whole evaluation, then a traceback writing --json into a directory."""
  for option, value, message in (
      ("--json", tmp_path, "is a directory: expected a file name"),
      ("--json", tmp_path / "missing" / "out.json", "does not exist (create it first)"),
      ("--results", tmp_path, "is a directory: expected a file name"),
      ("--results", fifo(tmp_path / "pipe.jsonl"), "is a FIFO: expected a file to append to")):
    r = cli("eval_similarity.py", "--bench", pairs, "--workdir", trained[1], option, value)
    assert f"argument {option}: {str(value)!r}" in one_line(r) and message in r.stderr
    assert r.stdout == ""  # nothing was evaluated


@pytest.mark.parametrize("case", ["export_hf_under_a_file", "gpu_check_json_directory",
                                  "report_output_file", "fetch_sources_under_a_file",
                                  "max_batch_json_missing_directory"])
def test_every_output_path_is_checked_as_it_is_parsed(trained, tmp_path, case):
  """An output under a file, a directory given for a file, a directory that does not exist:
  the argument's one line, before the tool reads, downloads or compiles anything."""
  file = tmp_path / "file"
  file.write_text("x\n")
  tool, args, option = {
      "export_hf_under_a_file": ("export_hf.py", ["--workdir", trained[1], "--output",
                                                  file / "hf"], "--output"),
      "gpu_check_json_directory": ("gpu_check.py", ["--allow-cpu", "--json", tmp_path],
                                   "--json"),
      "report_output_file": ("report.py", [file, "--output", file], "--output"),
      "fetch_sources_under_a_file": ("fetch_bench_sources.py", ["--output", file / "src"],
                                     "--output"),
      "max_batch_json_missing_directory": ("max_batch.py", ["--json", tmp_path / "no" / "r"],
                                           "--json"),
  }[case]
  r = cli(tool, *args)
  assert r.returncode == EXIT_USAGE, r.stderr[-3000:]
  assert f"argument {option}:" in r.stderr.strip().splitlines()[-1]  # max_batch: after usage
  assert os.listdir(tmp_path) == ["file"]


# ----------------------------------------------------------------------------- non-file inputs
@needs_gcc
@pytest.mark.parametrize("case", ["fill_mask_elf", "embed_elf", "embed_tokenizer",
                                  "finetune_pairs", "eval_similarity_bench", "leakage_train",
                                  "bench_disjoint_dir"])
def test_a_non_regular_input_file_is_refused_in_one_line(trained, pairs, tmp_path, case):
  """A FIFO never ends a read (was: a hang), a directory is no file: refused as parsed."""
  pipe, workdir = fifo(tmp_path / "pipe"), trained[1]
  tool, args, option, kind = {
      "fill_mask_elf": ("fill_mask.py", ["--workdir", workdir, "--elf", pipe, "--function",
                                         "main"], "--elf", "FIFO"),
      "embed_elf": ("embed.py", ["--workdir", workdir, "--elf", ELF, pipe, "--output",
                                 tmp_path / "e.npz"], "--elf", "FIFO"),
      "embed_tokenizer": ("embed.py", ["--workdir", workdir, "--tokenizer", pipe, "--elf", ELF,
                                       "--output", tmp_path / "e.npz"], "--tokenizer", "FIFO"),
      "finetune_pairs": ("finetune_similarity.py", ["--pairs", pipe, "--workdir",
                                                    tmp_path / "ft", "--init-workdir", workdir],
                         "--pairs", "FIFO"),
      "eval_similarity_bench": ("eval_similarity.py", ["--bench", pipe, "--workdir", workdir],
                                "--bench", "FIFO"),
      "leakage_train": ("similarity_leakage.py", ["--train", pipe, "--bench", pairs], "--train",
                        "FIFO"),
      "bench_disjoint_dir": ("build_similarity_bench.py", ["--sources", SOURCES,
                                                           "--disjoint-from", tmp_path,
                                                           "--output", tmp_path / "b.jsonl"],
                             "--disjoint-from", "directory"),
  }[case]
  err = one_line(cli(tool, *args))
  assert f"argument {option}:" in err and f"is a {kind}: expected a regular file to read" in err
  assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("where", ["dataset_metadata", "dataset_shard", "hf_config"])
def test_a_fifo_inside_a_given_directory_is_one_line(trained, tmp_path, where):
  """The files a tool finds inside a directory it is given are checked as they are opened."""
  data, workdir = trained
  if where == "hf_config":
    (tmp_path / "hf").mkdir()
    fifo(tmp_path / "hf" / "config.json")
    args = ("fill_mask.py", "--hf", tmp_path / "hf", "--text", "push rbp [NEXT] [MASK] rbp")
    want = "config.json is a FIFO"
  else:
    d = shutil.copytree(data, tmp_path / "ds")
    meta = json.loads((d / dataset.METADATA).read_text())
    name = (dataset.METADATA if where == "dataset_metadata"
            else meta["splits"]["validation"]["shards"][0]["file"])
    (d / name).unlink()
    fifo(d / name)
    args = ("evaluate.py", "--workdir", workdir, "--data", d)
    want = f"{name} is a FIFO"
  assert want in one_line(cli(*args))


def test_an_hf_config_that_is_no_object_is_one_line(tmp_path):
  """Was an AttributeError traceback from the HF reader (fill_mask, embed, eval_similarity
  --hf; import_hf; finetune --init-hf)."""
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text("[1, 2]\n")
  err = one_line(cli("fill_mask.py", "--hf", tmp_path / "hf", "--text", "push rbp [MASK]"))
  assert "config.json: an array, expected a Hugging Face model's config" in err


# ----------------------------------------------------------------------------- corrupt shards
def shard_copy(data: str, tmp_path, edit) -> tuple[str, str]:
  """A copy of the dataset whose train shard's bytes are ``edit(bytes)``."""
  d = shutil.copytree(data, tmp_path / "ds")
  shard = d / json.loads((d / dataset.METADATA).read_text())["splits"]["train"]["shards"][0]["file"]
  shard.write_bytes(edit(shard.read_bytes()))
  return str(d), str(shard)


def test_inspect_show_names_a_record_that_fails_its_hash(trained, tmp_path):
  """Was a RuntimeError traceback (only --verify was clean): --show reads through the loader's
  reader, whose error names the shard file and the record."""
  d, shard = shard_copy(trained[0], tmp_path, lambda b: b[:2000] + bytes(
      x ^ 0xFF for x in b[2000:2010]) + b[2010:])
  err = one_line(cli("inspect_shards.py", d, "--show", 1000))
  assert f"{shard}: record 10 (split record 10): unreadable" in err
  assert "chunk data hash mismatch" in err and "--verify checks every shard" in err


def test_a_shard_cut_at_a_block_boundary_says_why_it_cannot_be_opened(trained, tmp_path):
  """The loader's reader (training's, evaluate's): array_record's own reason is empty there (the
  error ended in ': '); the type is named, and the size against metadata.json's says what
  happened."""
  d, shard = shard_copy(trained[0], tmp_path, lambda b: b[:1 << 16])
  meta = dataset.DatasetMeta.load(d)
  size = meta.splits["train"]["shards"][0]["bytes"]
  with pytest.raises(dataset.DatasetError) as e:
    records.ShardRecords(meta, "train").read(np.array([0]))
  assert str(e.value) == (f"{shard}: cannot open ArrayRecord shard: RuntimeError without a "
                          f"message; the file has 65536 bytes, metadata.json says {size} (cut "
                          "short or replaced)")


# ----------------------------------------------------------------------------- fine-tuning
@needs_gcc
def test_finetuning_into_a_pretraining_workdir_says_what_it_holds(trained, pairs, tmp_path):
  """Was: 'not the file the checkpoint was trained on (sha256 None…)'."""
  workdir = shutil.copytree(trained[1], tmp_path / "run")
  err = one_line(cli("finetune_similarity.py", "--pairs", pairs, "--workdir", workdir,
                     "--init-workdir", trained[1], "--steps", 20, "--batch-size", 4))
  assert f"--workdir {workdir} holds a pretraining run" in err
  assert f"--init-workdir {workdir}" in err and "None" not in err
