"""A similarity claim over seeds and sets (lmscale_jax/evals/seeds.py, benchmarks/similarity_seeds.py):
rows as eval_similarity.py --json writes them (retrieval.Result.row)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmscale_jax.errors import UserError
from lmscale_jax.evals import retrieval, seeds
from tests.helpers import ROOT


def rows(values: dict[str, float], pair="all", pool=100, queries=500) -> list[dict]:
  return [retrieval.Result(m, pool, pair, queries, r, r + 0.1).row() for m, r in values.items()]


def results_file(path, values: dict[str, float]) -> str:
  path.write_text(json.dumps({"results": rows(values) + rows(values, pool=1000)}))
  return str(path)


def test_a_method_over_three_seeds_is_its_mean_and_half_its_range():
  found, = seeds.cells(rows({"ft-s0@600": 0.50, "ft-s1@600": 0.56, "ft-s2@600": 0.53,
                             "tfidf": 0.4}), "FT", ["ft-s*"])
  assert found.runs == ["ft-s0@600", "ft-s1@600", "ft-s2@600"] and found.queries == 500
  assert found.summary()["mean"] == pytest.approx(0.53)
  assert seeds.show(found) == "0.530 ± 0.030 (3)"


def test_a_comparison_pairs_runs_seed_by_seed_and_holds_only_where_every_seed_does():
  r = rows({"pre-s0": 0.60, "pre-s1": 0.55, "pre-s2": 0.58,
            "rand-s0": 0.50, "rand-s1": 0.57, "rand-s2": 0.52})
  (pre,), (rand,) = seeds.cells(r, "pre", ["pre-*"]), seeds.cells(r, "rand", ["rand-*"])
  c = seeds.compare(pre, rand)
  assert c["pairs_of_runs"] == [("pre-s0", "rand-s0"), ("pre-s1", "rand-s1"),
                                ("pre-s2", "rand-s2")]
  assert c["recall_at_1_diff"] == pytest.approx([0.10, -0.02, 0.06])
  assert c["mean"] == pytest.approx(0.14 / 3) and c["holds_every_run"] is False
  r2 = rows({"pre-s0": 0.60, "pre-s1": 0.59, "rand-s0": 0.50, "rand-s1": 0.57})
  (p2,), (q2,) = seeds.cells(r2, "pre", ["pre-*"]), seeds.cells(r2, "rand", ["rand-*"])
  assert seeds.compare(p2, q2)["holds_every_run"] is True


def test_a_one_run_baseline_is_compared_with_each_seed_and_other_counts_are_refused():
  r = rows({"pre-s0": 0.6, "pre-s1": 0.4, "rand-s0": 0.5, "rand-s1": 0.5, "rand-s2": 0.5,
            "tfidf": 0.45})
  (pre,), (rand,) = seeds.cells(r, "pre", ["pre-*"]), seeds.cells(r, "rand", ["rand-*"])
  (tfidf,) = seeds.cells(r, "TF-IDF", ["tfidf"])
  c = seeds.compare(pre, tfidf)
  assert c["pairs_of_runs"] == [("pre-s0", "tfidf"), ("pre-s1", "tfidf")]
  assert c["recall_at_1_diff"] == pytest.approx([0.15, -0.05]) and not c["holds_every_run"]
  with pytest.raises(UserError, match="pre has 2 runs at all, pool 100, and rand 3"):
    seeds.compare(pre, rand)


def test_a_group_matching_no_run_is_one_line_naming_the_methods_there_are():
  with pytest.raises(UserError, match=r"--group FT: ft-\* matches no method \(there are: a, b\)"):
    seeds.cells(rows({"a": 0.1, "b": 0.2}), "FT", ["ft-*"])
  with pytest.raises(UserError, match="expected LABEL=GLOB"):
    seeds.parse_group("no equals sign")


def test_the_table_shows_each_set_and_cell_and_the_comparison_per_seed(tmp_path):
  one = results_file(tmp_path / "one.json", {"pre-s0": 0.6, "pre-s1": 0.7, "rand-s0": 0.5,
                                              "rand-s1": 0.6, "tfidf": 0.45})
  two = results_file(tmp_path / "two.json", {"pre-s0": 0.4, "pre-s1": 0.5, "rand-s0": 0.45,
                                              "rand-s1": 0.45, "tfidf": 0.3})
  out = tmp_path / "out.json"
  p = subprocess.run(
      [sys.executable, "benchmarks/similarity_seeds.py", "--set", f"eval={one}",
       "--set", f"eval2={two}", "--group", "pre=pre-*", "--group", "rand=rand-*",
       "--group", "TF-IDF=tfidf", "--compare", "pre>rand", "--cells", "all@100,all@1000",
       "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert "| pre | 0.650 ± 0.050 (2) | 0.650 ± 0.050 (2) | 0.450 ± 0.050 (2) |" in p.stdout
  assert "| TF-IDF | 0.450 | 0.450 | 0.300 | 0.300 |" in p.stdout
  assert ("eval: all, pool 100: pre − rand = +0.100 (per seed +0.100, +0.100): holds at every "
          "seed") in p.stdout
  assert ("eval2: all, pool 1000: pre − rand = +0.000 (per seed -0.050, +0.050): does not "
          "hold at every seed") in p.stdout
  saved = json.loads(out.read_text())
  assert len(saved["cells"]) == 12 and len(saved["comparisons"]) == 4


def test_the_files_of_one_set_are_runs_paired_file_by_file(tmp_path):
  """Several draws of the pools (eval_similarity.py --seed): the k-th file's methods are
  METHOD/k, so one method over the draws is one group and two methods pair draw by draw."""
  files = [results_file(tmp_path / f"{k}.json", {"run@3000": m, "random-init": r})
           for k, (m, r) in enumerate([(0.40, 0.42), (0.41, 0.40), (0.39, 0.43)])]
  p = subprocess.run(
      [sys.executable, "benchmarks/similarity_seeds.py", "--set", "eval=" + ",".join(files),
       "--group", "MLM=run@*", "--group", "random=random-init*", "--compare", "random>MLM",
       "--cells", "all@100"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert "| MLM | 0.400 ± 0.010 (3) |" in p.stdout
  assert "random − MLM = +0.017 (per seed +0.020, -0.010, +0.040): does not hold" in p.stdout


def test_a_bad_results_file_is_one_line_and_exit_1(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  p = subprocess.run([sys.executable, "benchmarks/similarity_seeds.py", "--set", f"e={bad}",
                      "--group", "x=y"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert p.returncode == 1 and p.stdout == ""
  assert p.stderr.startswith(f"error: {bad}: not an eval_similarity.py --json file")
  assert len(p.stderr.strip().splitlines()) == 1


def test_a_comparison_naming_no_group_is_one_line_and_exit_1(tmp_path):
  one = results_file(tmp_path / "one.json", {"pre-s0": 0.6, "rand-s0": 0.5})
  p = subprocess.run([sys.executable, "benchmarks/similarity_seeds.py", "--set", f"e={one}",
                      "--group", "pre=pre-*", "--compare", "pre>rand"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert p.returncode == 1 and p.stdout == ""
  assert p.stderr == "error: --compare: 'rand' is no --group label (['pre'])\n"


@pytest.mark.parametrize("study", ["similarity_claims", "longer_functions"])
def test_a_study_wants_its_directory_and_starts_nothing_without_it(study):
  """benchmarks/similarity_claims.sh and longer_functions.sh run for hours: no argument, or a
  flag, is one line."""
  for argv in ([], ["--steps"]):
    p = subprocess.run(["bash", f"benchmarks/{study}.sh", *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("error: give the study's directory") and p.stderr.count("\n") == 1
  p = subprocess.run(["bash", f"benchmarks/{study}.sh", "--help"], cwd=ROOT,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 0 and f"bash benchmarks/{study}.sh OUT" in p.stdout


def test_the_longer_functions_table_of_an_unfinished_study_is_one_line(tmp_path):
  p = subprocess.run([sys.executable, "benchmarks/longer_functions_table.py", "--study",
                      str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert p.returncode == 1 and p.stdout == ""
  assert p.stderr.startswith(f"error: {tmp_path}/budget.json: not readable JSON")
  assert p.stderr.count("\n") == 1
