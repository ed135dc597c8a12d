"""Preparation as Slurm job-array stages: byte for byte the single-node output, under a fake
Slurm whose sbatch runs each array's tasks at once as real processes on this machine; completion
markers make a rerun redo only what is missing; a stage run too early is one line."""

from __future__ import annotations

import filecmp
import json
import os
import socket
import subprocess
import sys

import pytest

from lmscale_jax.prep import cluster_extract, cluster_stages, output_dir, packing, prepare
from lmscale_jax.store import dataset
from tests.test_bad_input_prepare import cli, one_line
from tests.helpers import lmscale
from tests.test_prepare import opts, small_elves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "prepare.sbatch")
# Small chunks, pieces and shards: several of each from ~2 MB of libraries.
SETTINGS = {"chunk_mb": 0.05, "shard_size_mb": 0.05}
FLAGS = ["--seq-len", "128", "--vocab-size", "2000", "--val-fraction", "0.05", "--chunk-mb",
         "0.05", "--shard-size-mb", "0.05", "--slices", "4", "--buckets", "3"]

FAKE_SBATCH = r"""#!/bin/bash
# Records the call; runs the job now (so --dependency=afterok holds by construction): an array's
# tasks at once, each with Slurm's array variables; a job after a failed one never runs.
echo "sbatch $*" >> "$FAKE_SLURM/calls.log"
array="" after="" exports=""
while [[ "${1:-}" == -* ]]; do
  case "$1" in
    --array=*) array=${1#--array=0-} ;;
    --dependency=afterok:*) after=${1#--dependency=afterok:} ;;
    --export=*) exports=${1#--export=} ;;
  esac
  shift
done
script=$1; shift
id=$(( $(cat "$FAKE_SLURM/next_id" 2>/dev/null || echo 100) + 1 ))
echo "$id" > "$FAKE_SLURM/next_id"
echo "$id"
if [[ -n $after ]] && grep -qx "$after" "$FAKE_SLURM/failed" 2>/dev/null; then
  echo "$id" >> "$FAKE_SLURM/failed"; exit 0
fi
vars=(); IFS=, read -ra kv <<< "$exports"
for x in "${kv[@]}"; do [[ $x == ALL ]] || vars+=("$x"); done
# FAKE_TIME_LIMIT="STAGE SECONDS": that stage's tasks are killed after SECONDS, as Slurm's
# time limit does (SIGKILL once the grace time is over).
limit=(); read -r stage seconds <<< "${FAKE_TIME_LIMIT:-}"
[[ -n ${stage:-} && $exports == *PREP_STAGE=$stage,* ]] && limit=(timeout -s KILL "$seconds")
n=$(( ${array:-0} + 1 )); pids=()
for ((i = 0; i < n; i++)); do
  task=(); [[ -n $array ]] && task=(SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=$n)
  env "${vars[@]}" "${task[@]}" SLURM_JOB_ID=$id "${limit[@]}" bash "$script" "$@" \
    > "$FAKE_SLURM/job-${id}_$i.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || echo "$id" >> "$FAKE_SLURM/failed"; done
exit 0
"""


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
  out = tmp_path_factory.mktemp("single") / "ds"
  return out, prepare.prepare(opts(out, workers=1, **SETTINGS))


def assert_same_dataset(a, b):
  """Every file byte for byte, but stats.json's timings (wall, stage seconds, rates)."""
  assert sorted(os.listdir(a)) == sorted(os.listdir(b))
  for name in os.listdir(a):
    if name != dataset.STATS:
      assert filecmp.cmp(a / name, b / name, shallow=False), name
  timing = {"wall_seconds", "stage_seconds", "mb_per_s_per_core", "workers"}
  sa, sb = (json.loads((d / dataset.STATS).read_text()) for d in (a, b))
  assert {k: v for k, v in sa.items() if k not in timing} == \
      {k: v for k, v in sb.items() if k not in timing}


def test_without_the_token_ids_extension_the_dataset_is_the_same(tmp_path, single_node,
                                                                 monkeypatch):
  """prep/_token_ids.c (counts, ids, packing) against its Python references, end to end: the
  fallback where the extension cannot build writes the same bytes."""
  if packing.token_ids_module() is None:
    pytest.skip("the _token_ids extension is not built: the fixture ran the fallback already")
  monkeypatch.setattr(packing, "token_ids_module", lambda: None)
  out = tmp_path / "ds"
  prepare.prepare(opts(out, workers=1, **SETTINGS))
  assert_same_dataset(single_node[0], out)


class FakeSlurm:
  def __init__(self, tmp_path):
    self.dir = tmp_path / "slurm"
    (self.dir / "bin").mkdir(parents=True)
    (self.dir / "bin" / "sbatch").write_text(FAKE_SBATCH)
    os.chmod(self.dir / "bin" / "sbatch", 0o755)
    self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PREP_"))}
    self.env.update(PATH=f"{self.dir / 'bin'}:{os.environ['PATH']}", FAKE_SLURM=str(self.dir),
                    SLURM_SUBMIT_DIR=ROOT, SLURM_JOB_ID="100", SLURM_CPUS_ON_NODE="1",
                    PYTHON=sys.executable, PREP_TASKS="3")

  def submit(self, args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SBATCH, *map(str, args)], cwd=ROOT, env=self.env,
                          capture_output=True, text=True, timeout=600)

  def calls(self) -> list[str]:
    return (self.dir / "calls.log").read_text().splitlines()

  def logs(self) -> str:
    return "".join(p.read_text() for p in sorted(self.dir.glob("job-*.log")))


def test_a_3_task_array_chain_writes_the_single_node_dataset_byte_for_byte(tmp_path,
                                                                           single_node):
  slurm, out = FakeSlurm(tmp_path), tmp_path / "cluster"
  r = slurm.submit(["--input", *small_elves(), "--output", out, "--no-progress", *FLAGS])
  assert r.returncode == 0, r.stderr + slurm.logs()
  chain = "extract 101 → dedup 102 → layout 103 → pack 104 → shards 105 → finish 106"
  assert f"submitted: {chain}" in r.stdout, r.stdout
  calls = slurm.calls()
  assert [c.split("--job-name=lmscale-prep-")[1].split()[0] for c in calls] == \
      ["extract", "dedup", "layout", "pack", "shards", "finish"]
  assert all("--array=0-2" in c for i, c in enumerate(calls) if i in (0, 1, 3, 4)), calls
  assert all(f"--dependency=afterok:{101 + i}" in c for i, c in enumerate(calls[1:])), calls
  assert not (slurm.dir / "failed").exists(), slurm.logs()
  assert_same_dataset(single_node[0], out)
  assert not (out / output_dir.WORK).exists()
  stages = json.loads((out / dataset.STATS).read_text())["stage_seconds"]
  assert stages.keys() == single_node[1]["stage_seconds"].keys() and stages["write"] > 0


def test_a_rerun_redoes_only_the_units_without_a_marker(tmp_path, single_node):
  """Slice 0 extracted by an earlier array task, and a stage run too early: the first says
  which input is missing in one line; the chain's rerun keeps slice 0 and ends identical."""
  out = tmp_path / "rerun"
  tool = lmscale("prepare_cluster")
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  run = lambda *a: subprocess.run([*tool, *map(str, a)], env=env, capture_output=True,  # noqa: E731
                                  text=True, timeout=300)
  r = run("plan", "--input", *small_elves(), "--output", out, "--no-progress", *FLAGS)
  assert r.returncode == 0, r.stderr
  assert run("extract", "--output", out, "--task", 0, "--tasks", 3, "--workers", 1).returncode == 0
  early = run("dedup", "--output", out)
  assert early.returncode == 1 and early.stderr.count("\n") == 1, early.stderr
  assert "slice-00001.json is missing (and 2 more); rerun the extract stage" in early.stderr
  assert "extract: 1 of 4 slices done" in run("status", "--output", out).stdout

  slurm = FakeSlurm(tmp_path)
  r = slurm.submit(["--input", *small_elves(), "--output", out, "--no-progress", *FLAGS])
  assert r.returncode == 0 and not (slurm.dir / "failed").exists(), r.stderr + slurm.logs()
  assert "extract: slice 0 done already" in slurm.logs()
  assert "extract: slice 1 done:" in slurm.logs()  # redone: only the missing ones
  assert_same_dataset(single_node[0], out)


def test_a_task_killed_at_its_time_limit_stops_the_chain_and_the_same_command_finishes_it(
    tmp_path, single_node):
  """The shards array killed (SIGKILL, as at a time limit): finish never runs (afterok), the
  dataset is not there; the same sbatch command again keeps every done unit and ends
  identical."""
  slurm, out = FakeSlurm(tmp_path), tmp_path / "killed"
  args = ["--input", *small_elves(), "--output", out, "--no-progress", *FLAGS]
  slurm.env["FAKE_TIME_LIMIT"] = "shards 0.2"
  assert slurm.submit(args).returncode == 0
  failed = sorted(set((slurm.dir / "failed").read_text().split()))
  assert failed == ["105", "106"], failed  # shards, then finish: its dependency never held
  assert not (out / dataset.METADATA).exists() and (out / output_dir.WORK).is_dir()
  del slurm.env["FAKE_TIME_LIMIT"]
  (slurm.dir / "failed").unlink()
  r = slurm.submit(args)
  assert r.returncode == 0 and not (slurm.dir / "failed").exists(), r.stderr + slurm.logs()
  assert "extract: slice 0 done already" in slurm.logs()
  assert "layout: done already" in slurm.logs()
  assert_same_dataset(single_node[0], out)


def run_stages(output, tasks: int, workers: int = 1) -> dict:
  """Every stage in this process, each array stage as ``tasks`` tasks in turn."""
  for t in range(tasks):
    cluster_extract.extract(str(output), t, tasks, workers)
  for t in range(tasks):
    cluster_extract.dedup(str(output), t, tasks)
  cluster_stages.layout(str(output), workers)
  for stage in (cluster_stages.pack, cluster_stages.shards):
    for t in range(tasks):
      stage(str(output), t, tasks, workers)
  return cluster_stages.finish(str(output))


def test_text_corpora_and_pools_of_two_give_the_single_node_dataset_too(tmp_path):
  """With the tokenizer given: HF's trainer of text tokenizers orders ties by a per-process
  hash seed, so two single-node runs that train one differ too (measured: 3 runs, 3 hashes)."""
  src = tmp_path / "docs.txt"
  words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
  src.write_text("".join(f"{words[i % 8]} {words[(i * 7) % 8]} number {i % 300} "
                         f"{' '.join(words[:i % 8])}\n" for i in range(6000)))
  kw = dict(kind="text", vocab_size=300, chunk_mb=0.02, shard_size_mb=0.02)
  prepare.prepare(opts(tmp_path / "trained", [str(src)], workers=1, **kw))
  kw["tokenizer"] = str(tmp_path / "trained" / dataset.TOKENIZER)
  prepare.prepare(opts(tmp_path / "one", [str(src)], workers=1, **kw))
  cluster_extract.plan(opts(tmp_path / "array", [str(src)], **kw), slices=3, buckets=2)
  run_stages(tmp_path / "array", tasks=2, workers=2)
  assert_same_dataset(tmp_path / "one", tmp_path / "array")


def test_status_counts_each_stages_done_units(tmp_path):
  out = tmp_path / "s"
  cluster_extract.plan(opts(out, small_elves(2), shard_size_mb=0.05), slices=2, buckets=2)
  for t in range(2):
    cluster_extract.extract(str(out), t, 2, 1)
  for t in range(2):
    cluster_extract.dedup(str(out), t, 2)
  cluster_stages.layout(str(out), 1)
  cluster_stages.pack(str(out), 0, 1, 1)
  cluster_stages.shards(str(out), 0, 2, 1)
  lines = cluster_stages.status(str(out))
  assert lines[1:5] == ["extract: 2 of 2 slices done", "dedup: 2 of 2 buckets done",
                        "layout: done", "pack: 1 of 1 pieces done"], lines
  done, total = map(int, lines[5].removeprefix("shards: ").split(" shards")[0].split(" of "))
  assert 0 < done < total, lines


def test_a_single_node_run_refuses_the_work_of_a_cluster_run(tmp_path):
  out = tmp_path / "o"
  cluster_extract.plan(opts(out, small_elves(2)), slices=2, buckets=2)
  with pytest.raises(prepare.PrepareError, match="engine differ.*--overwrite"):
    prepare.prepare(opts(out, small_elves(2)))


def test_array_tasks_share_the_output_and_a_single_node_run_is_refused_it_and_the_reverse(
    tmp_path):
  """This process holds the output's lock as an array task does (shared), then as a
  single-node run does (exclusive); the tools run beside it as real processes."""
  out = tmp_path / "o"
  inputs = small_elves(2)
  cluster_extract.plan(opts(out, inputs), slices=2, buckets=2)
  holder = f"pid {os.getpid()} on host {socket.gethostname()}, since "
  with cluster_extract.held(str(out), "extract"):
    err = one_line(cli("prepare_binary.py", "--input", *inputs, "--output", out, "--overwrite"))
    assert "is in use by a cluster preparation's extract stage (the latest of its holders to " \
           f"start: {holder}" in err, err
    r = cli("prepare_cluster.py", "extract", "--output", out, "--task", "0", "--tasks", "2",
            "--workers", "1")
    assert r.returncode == 0, r.stderr  # another task of the array: never blocked
  with output_dir.output_lock(str(out)):
    err = one_line(cli("prepare_cluster.py", "extract", "--output", out, "--task", "1",
                       "--tasks", "2", "--workers", "1"))
    assert f"is in use by a single-node preparation ({holder}" in err, err
  assert os.path.exists(cluster_extract.slice_file(str(out / output_dir.WORK), 0, ".json"))
  assert not os.path.exists(cluster_extract.slice_file(str(out / output_dir.WORK), 1, ".json"))


@pytest.mark.parametrize("args,says", [
    (["frobnicate"], "stage 'frobnicate': expected one of plan, extract"),
    (["pack", "--output", "/nonexistent/ds"], "no plan; run the plan stage first"),
    (["extract", "--output", "OUT", "--task", "3", "--tasks", "3"], "--task 3: expected 0..2"),
], ids=["unknown stage", "no plan", "task out of range"])
def test_a_bad_stage_call_is_one_line(tmp_path, args, says):
  if "OUT" in args:
    out = tmp_path / "ds"
    cluster_extract.plan(opts(out, small_elves(1)), slices=1, buckets=1)
    args = [str(out) if a == "OUT" else a for a in args]
  assert says in one_line(cli("prepare_cluster.py", *args))


@pytest.mark.parametrize("env,says", [({"PREP_TASKS": "0"}, "PREP_TASKS=0: expected a positive"),
                                      ({}, "give --output DIR")], ids=["tasks", "output"])
def test_bad_sbatch_settings_are_one_line_before_anything_is_submitted(tmp_path, env, says):
  slurm = FakeSlurm(tmp_path)
  slurm.env.update(env)
  args = ["--input", *small_elves(1)] + (["--output", tmp_path / "o"] if env else [])
  assert says in one_line(slurm.submit(args), code=1)  # the one code of a user error
  assert not (slurm.dir / "calls.log").exists() and not (tmp_path / "o").exists()
