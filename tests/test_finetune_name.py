"""Function-naming fine-tuning end to end (lmscale finetune --task name,
finetune/name_run.py): a small naming task built as lmscale naming-build builds one (each of
tests/data/similarity's functions compiled by the machine's gcc at -O0 and -O3; its name split
into sub-tokens; split by library: strings.c's functions held out), started from
tests/test_finetune.py's real 2-step pretraining run.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from lmscale_jax.errors import UserError
from lmscale_jax.evals import naming
from lmscale_jax.inference import callee_copy
from lmscale_jax.finetune import name_run
from lmscale_jax.inference import name_suggestions, trained_model
from lmscale_jax.model import name_head
from tests.test_finetune import bench, pretrained, rows  # noqa: F401 (fixtures)
from tests.test_hf_tools import run_tool

STEPS = 60
EVAL_EVERY = 30
TEST_LIBRARY = "similarity/strings.c"
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def sub_tokens(name: str) -> list[str]:
  """snake_case, camelCase and digits → lowercase sub-tokens (naming-build's split)."""
  spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", name)
  return [t.lower() for t in re.findall(r"[A-Za-z]+|[0-9]+", spaced)]


def write_jsonl(path, objects) -> None:
  path.write_text("".join(json.dumps(o) + "\n" for o in objects))


def called(name: str) -> list[str]:
  """What the fixture's functions call (naming-build's "calls"): an import named after the
  function's first sub-token, as a library's helpers often are, and one that tells nothing."""
  return [f"{sub_tokens(name)[0]}_helper", "free"]


@pytest.fixture(scope="module")
def task_dir(bench, tmp_path_factory):
  """DIR with train.jsonl and test.jsonl in naming-build's format."""
  groups = [json.loads(x) for x in open(bench).read().splitlines()[1:]]
  out = tmp_path_factory.mktemp("naming")

  def functions(part):
    return [{"text": v["text"], "name": g["name"], "tokens": sub_tokens(g["name"]),
             "library": g["source"], "function": g["name"], "binary": variant,
             "calls": called(g["name"])}
            for g in part for variant, v in sorted(g["variants"].items())]

  write_jsonl(out / "train.jsonl", functions([g for g in groups if g["source"] != TEST_LIBRARY]))
  write_jsonl(out / "test.jsonl", functions([g for g in groups if g["source"] == TEST_LIBRARY]))
  return out


def args(task_dir, pretrained, workdir, *extra) -> list[str]:
  return [str(a) for a in (
      "--task", "name", "--labels", task_dir / "train.jsonl", "--eval-labels",
      task_dir / "test.jsonl", "--workdir", workdir, "--init-workdir", pretrained[1],
      "--steps", STEPS, "--batch-size", 16, "--learning-rate", 2e-3, "--warmup-steps", 3,
      "--dropout", 0.0, "--log-every", 1, "--eval-every", EVAL_EVERY, "--checkpoint-every", 30,
      *extra)]


def train_rows(workdir, key="loss") -> dict:
  return {r["step"]: r[key] for r in rows(workdir) if key in r}


@pytest.fixture(scope="module")
def named(task_dir, pretrained, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("name") / "run"
  from lmscale_jax.cli import finetune

  assert finetune.main(args(task_dir, pretrained, workdir)) == 0
  return workdir


def test_a_naming_finetune_lowers_its_loss_and_writes_its_scores(named, task_dir):
  loss = train_rows(named)
  first, last = np.mean([loss[s] for s in range(1, 6)]), np.mean(
      [loss[s] for s in range(STEPS - 4, STEPS + 1)])
  report = json.load(open(named / name_run.EVAL_REPORT))
  print(f"BCE loss steps 1-5 {first:.3f} → {last:.3f}; held-out precision "
        f"{report['precision']:.3f} recall {report['recall']:.3f} F1 {report['f1']:.3f} exact "
        f"{report['exact']:.3f}; rule {report['rule']}; rules {report['rules']}")
  assert sorted(loss) == list(range(1, STEPS + 1)) and last < 0.9 * first  # 9.50 → 7.93
  assert report["step"] == STEPS and report["functions"] == len(report["predictions"])
  test = [json.loads(x) for x in open(task_dir / "test.jsonl").read().splitlines()]
  assert report["functions"] == len(test)
  # The report's numbers are evals/naming.score's of its own predictions.
  again = naming.score([p["predicted"] for p in report["predictions"]],
                       [p["tokens"] for p in report["predictions"]])
  assert {k: report[k] for k in again} == again
  assert report["rule"]["kind"] in name_head.RULES
  assert set(report["rules"]) == set(name_head.RULES)
  first_p = report["predictions"][0]
  assert first_p["tokens"] == test[0]["tokens"] and first_p["function"] == test[0]["function"]
  assert len(first_p["top"]) == 5 and first_p["top"][0][1] >= first_p["top"][1][1]
  vocab = name_head.load_vocab(str(named))
  assert report["vocabulary"] == len(vocab["tokens"]) and vocab["min_count"] == 2
  evals = train_rows(named, "eval_f1")
  assert sorted(evals) == [EVAL_EVERY, STEPS] and evals[STEPS] == report["f1"]
  assert "f1" in rows(named)[0]
  model = trained_model.load(workdir=str(named))
  assert model.namer["tokens"] == vocab["tokens"] and model.classifier is None
  assert model.namer["kernel"].shape == (64, len(vocab["tokens"]))


def test_a_task_with_calls_keeps_copy_rates_and_the_rule_reads_them_where_they_help(named):
  """The fixture's functions call a helper named after their first sub-token: the calibration
  slice prefers the rule reading the called names, and the report keeps the model's own."""
  report = json.load(open(named / name_run.EVAL_REPORT))
  rates = callee_copy.load(str(named))
  assert rates is not None and rates.called["free"] > 0 and rates.rate("free") < 0.5
  assert report["rule"]["calls"] is True
  alone = report["without_calls"]
  assert alone["rule"]["kind"] in name_head.RULES and "calls" not in alone["rule"]
  assert report["f1"] > alone["f1"] and report["recall"] > alone["recall"]
  namer = name_suggestions.load(str(named))
  text = "push rbp [NEXT] mov rbp rsp [NEXT] pop rbp [NEXT] ret"
  token = max(sorted(rates.called), key=rates.rate)  # copied by nearly every caller
  calls = [[f"{token}_helper"]]
  with_calls = name_suggestions.suggest(namer, [text], 5, calls=calls)[0]
  # lmscale name joins them as the evaluation did: the gate fitted on the calibration slice.
  gate = callee_copy.gate_from_json(report["rule"]["gate"])
  best = name_suggestions.ranked(namer.model, [text], name_head.TOP)
  names, scores = callee_copy.gated(*best, rates, calls, gate, name_head.TOP)
  assert with_calls["tokens"] == [[t, round(p, 4)] for t, p in zip(names[0][:5], scores[0][:5])]
  assert token in callee_copy.candidates(*(b[0] for b in best), rates, calls[0])[0]


def test_a_damaged_gate_in_the_rule_is_one_line_at_load(named, tmp_path):
  other = tmp_path / "run"
  shutil.copytree(named, other)
  report = json.load(open(other / name_run.EVAL_REPORT))
  report["rule"]["gate"]["weights"] = "x"
  json.dump(report, open(other / name_run.EVAL_REPORT, "w"))
  with pytest.raises(UserError, match=r"its prediction rule's gate is unreadable .*restore"):
    name_suggestions.load(str(other))


def test_an_empty_name_is_refused_in_one_line_before_work(task_dir, pretrained, tmp_path,
                                                          capsys):
  bad = tmp_path / "train.jsonl"
  write_jsonl(bad, [{"text": "ret", "tokens": ["ret"]}, {"text": "ret", "tokens": []}])
  argv = args(task_dir, pretrained, tmp_path / "w")
  argv[argv.index("--labels") + 1] = str(bad)
  code, _, err = run_tool("finetune", argv, capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert f"{bad}:2: \"tokens\" is [], expected a non-empty list" in err
  assert not (tmp_path / "w").exists()


def test_calls_that_are_not_a_list_of_names_are_one_line_before_work(task_dir, pretrained,
                                                                     tmp_path, capsys):
  bad = tmp_path / "train.jsonl"
  write_jsonl(bad, [{"text": "ret", "tokens": ["ret"], "calls": "free"}])
  argv = args(task_dir, pretrained, tmp_path / "w")
  argv[argv.index("--labels") + 1] = str(bad)
  code, _, err = run_tool("finetune", argv, capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert f"{bad}:1: \"calls\" is 'free', expected a list of the names" in err
  assert not (tmp_path / "w").exists()


def test_a_file_without_a_frequent_token_has_no_usable_names(task_dir, pretrained, tmp_path,
                                                             capsys):
  bad = tmp_path / "train.jsonl"
  write_jsonl(bad, [{"text": "ret", "tokens": [f"t{i}"]} for i in range(40)])
  argv = args(task_dir, pretrained, tmp_path / "w")
  argv[argv.index("--labels") + 1] = str(bad)
  code, _, err = run_tool("finetune", argv, capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert "no usable names to learn" in err and "name_min_count=2" in err


def test_a_task_whose_vocabulary_is_not_the_runs_is_refused_in_one_line(named, task_dir,
                                                                       pretrained, capsys):
  before = sorted(p.name for p in named.iterdir())
  code, _, err = run_tool("finetune", args(task_dir, pretrained, named, "--steps", STEPS + 10,
                                           "--config.finetune.name_min_count=3"), capsys)
  assert code == 1 and err.count("\n") == 1, err
  assert "the model's name vocabulary" in err and "is not this task's" in err
  assert sorted(p.name for p in named.iterdir()) == before


def test_a_librarys_own_tokens_are_those_in_half_its_names_and_leave_only_its_targets():
  """A namespace (``xml`` in every libxml name) is that library's own and no target there;
  the same token in another library's names stays; a library of few names keeps its tokens."""
  from lmscale_jax.finetune import name_labels

  big = [["xml", "read", "file"], ["xml", "free"], ["xml", "new", "node"], ["xml", "get", "x"]]
  libraries = ["libxml"] * 20 + ["libz"] * 20 + ["tiny"] * 3
  names = big * 5 + [["inflate", "xml"]] * 2 + [["deflate", "init"]] * 18 + [["tiny", "x"]] * 3
  own = name_labels.own_tokens(libraries, names, 0.5)
  assert own == {"libxml": frozenset({"xml"}), "libz": frozenset({"deflate", "init"}),
                 "tiny": frozenset()}
  assert name_labels.own_tokens(libraries, names, 0.0)["libxml"] == frozenset()
  named = name_labels.Named("f", "sha", ["t"] * len(names), names, list(range(len(names))),
                            [{"library": lib} for lib in libraries])
  left = name_labels.without_own(named, 0.5)
  assert left.tokens[0] == ["read", "file"] and left.tokens[20] == ["inflate", "xml"]
  assert left.tokens[22] == [] and left.tokens[-1] == ["tiny", "x"]
  assert named.tokens[0] == ["xml", "read", "file"]  # the whole names stay for the rule


def test_a_library_share_outside_0_to_1_is_one_line(task_dir, pretrained, tmp_path, capsys):
  from lmscale_jax.cli import finetune

  code = finetune.main(args(task_dir, pretrained, tmp_path / "run",
                            "--config.finetune.name_library_share=1.5"))
  err = capsys.readouterr().err.strip()
  assert code != 0 and err.count("\n") == 0 and "finetune.name_library_share=1.5" in err
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_finished_run_rescored_chooses_its_rule_again_and_scores_as_its_last_evaluation(
    named, tmp_path, capsys):
  """benchmarks/naming_rescore.py: the run's calibration slice and held-out file, inference as
  lmscale name runs it; with the grid the run had, the run's own rule and scores."""
  from benchmarks import naming_rescore

  out = tmp_path / "rescored.json"
  assert naming_rescore.main(["--workdir", str(named), "--json", str(out)]) == 0
  again, report = json.load(open(out)), json.load(open(named / name_run.EVAL_REPORT))
  assert again["step"] == STEPS and again["functions"] == report["functions"]
  assert again["thresholds"] == list(name_run.THRESHOLDS)
  assert again["rule"]["kind"] == report["rule"]["kind"]
  for k in ("precision", "recall", "f1", "exact"):
    assert abs(again[k] - report[k]) < 1e-3, (k, again[k], report[k])
  assert f"F1 {again['f1']:.4f}" in capsys.readouterr().out


def test_a_run_rescored_with_a_rebuild_of_its_task_reads_the_rebuilds_calls(
    named, task_dir, tmp_path, capsys):
  """--task: the same examples without "calls" score as the run's own rule without them; a
  task of other examples is one line."""
  from benchmarks import naming_rescore

  bare = tmp_path / "bare"
  bare.mkdir()
  for name in ("train.jsonl", "test.jsonl"):
    rows = [json.loads(x) for x in open(task_dir / name).read().splitlines()]
    write_jsonl(bare / name, [{k: v for k, v in r.items() if k != "calls"} for r in rows])
  out = tmp_path / "bare.json"
  assert naming_rescore.main(["--workdir", str(named), "--task", str(bare), "--json",
                              str(out)]) == 0
  again, report = json.load(open(out)), json.load(open(named / name_run.EVAL_REPORT))
  assert "calls" not in again["rule"] and again["task"] == str(bare)
  assert abs(again["f1"] - report["without_calls"]["f1"]) < 1e-3
  capsys.readouterr()
  (bare / "test.jsonl").write_text((bare / "test.jsonl").read_text().split("\n", 1)[1])
  assert naming_rescore.main(["--workdir", str(named), "--task", str(bare), "--json",
                              str(tmp_path / "no.json")]) == 1
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"error: --task {bare}: its test.jsonl is not the run's ") and "\n" not in err
  assert not (tmp_path / "no.json").exists()


def test_rescoring_never_replaces_a_file_it_did_not_write(named, capsys):
  """--json naming the run's own naming_eval.json: one line, before any work, file untouched."""
  from benchmarks import naming_rescore

  report = named / name_run.EVAL_REPORT
  before = report.read_bytes()
  with pytest.raises(SystemExit) as e:
    naming_rescore.main(["--workdir", str(named), "--json", str(report)])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 1 and len(err) == 1 and "is not an earlier output" in err[0], err
  assert report.read_bytes() == before
