"""Each Slurm task's GPUs (topology.slurm_devices) over the layouts Slurm produces, the
environment of a task as Slurm sets it in, the device ids out; and the derived port."""

from __future__ import annotations

import pytest

from lmscale_jax.cluster import topology
from tests.helpers import make_config


def task_env(tasks_per_node, local_id, visible=None, step_gpus=None, gpus_per_task=None,
             nodes=2) -> dict:
  """One task's Slurm variables on node 0 of ``nodes`` (``visible``: CUDA_VISIBLE_DEVICES)."""
  env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(local_id),
         "SLURM_LOCALID": str(local_id), "SLURM_NODEID": "0",
         "SLURM_NTASKS": str(tasks_per_node * nodes),
         "SLURM_STEP_NODELIST": f"gpu[01-{nodes:02d}]",
         "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})"}
  if visible is not None:
    env["CUDA_VISIBLE_DEVICES"] = visible
  if step_gpus is not None:
    env["SLURM_STEP_GPUS"] = step_gpus
    env["SLURM_GPUS_ON_NODE"] = str(len(step_gpus.split(",")))
  if gpus_per_task is not None:
    env["SLURM_GPUS_PER_TASK"] = str(gpus_per_task)
  return env


EIGHT = "0,1,2,3,4,5,6,7"
LAYOUTS = [
    # (layout, env, devices of this task: indices into what it sees; None = all it sees)
    ("8 tasks/node, 8 GPUs, no binding: GPU LOCALID",
     task_env(8, 5, visible=EIGHT, step_gpus=EIGHT), (5,)),
    ("--gpus-per-task=1, 8 tasks/node: its one GPU",
     task_env(8, 5, visible="5", step_gpus=EIGHT, gpus_per_task=1), None),
    ("--gpu-bind=map_gpu, 4 tasks/node: its one GPU",
     task_env(4, 2, visible="2", step_gpus="0,1,2,3"), None),
    ("one task per node: every GPU", task_env(1, 0, visible=EIGHT, step_gpus=EIGHT), None),
    ("--gpus-per-task=2, 4 tasks/node: both of its GPUs",
     task_env(4, 3, visible="6,7", step_gpus=EIGHT, gpus_per_task=2), None),
    ("--gpus-per-task=2, 4 tasks/node, without SLURM_STEP_GPUS",
     {**task_env(4, 3, visible="6,7", gpus_per_task=2), "SLURM_GPUS_ON_NODE": "8"}, None),
    ("--gpus-per-task=2, 2 tasks/node (as many visible as tasks, but bound)",
     task_env(2, 1, visible="2,3", step_gpus="0,1,2,3", gpus_per_task=2), None),
    ("cgroup-restricted, renumbered: 2 tasks see 0,1 of a 2-GPU step",
     task_env(2, 1, visible="0,1", step_gpus="4,5"), (1,)),
    ("no GPUs (CPU nodes)", task_env(4, 3), None),
    ("JAX_PLATFORMS=cpu on a GPU node", {**task_env(4, 3, visible=EIGHT, step_gpus=EIGHT),
                                         "JAX_PLATFORMS": "cpu"}, None),
]
AMBIGUOUS = [
    ("--gpu-bind=closest: 8 tasks share 2 sets of 4 GPUs",
     task_env(8, 5, visible="4,5,6,7", step_gpus=EIGHT)),
    ("--gpus-per-node=4 --ntasks-per-node=2 without binding (2 GPUs would idle)",
     task_env(2, 1, visible="0,1,2,3", step_gpus="0,1,2,3")),
    ("--gpus-per-task=2, 4 tasks/node, nothing says the node has 8",
     task_env(4, 3, visible="6,7")),
    ("more tasks than GPUs", task_env(4, 3, visible="0,1", step_gpus="0,1")),
]


@pytest.mark.parametrize("env,devices", [row[1:] for row in LAYOUTS],
                         ids=[row[0] for row in LAYOUTS])
def test_each_slurm_layout_gives_the_task_its_own_gpus(env, devices):
  t = topology.resolve(make_config().distributed, env)
  assert t.multi and t.local_device_ids == devices


@pytest.mark.parametrize("env", [row[1] for row in AMBIGUOUS], ids=[row[0] for row in AMBIGUOUS])
def test_an_ambiguous_layout_is_one_error_naming_the_variables(env):
  with pytest.raises(topology.DistributedError) as e:
    topology.resolve(make_config().distributed, env)
  message = str(e.value)
  for name in ("SLURM_LOCALID", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_TASKS_PER_NODE",
               "SLURM_STEP_GPUS", "LMSCALE_LOCAL_DEVICE_IDS", "--gpus-per-task"):
    assert name in message, message
  assert "\n" not in message
  # Naming the devices settles it: no error.
  env = {**env, "LMSCALE_LOCAL_DEVICE_IDS": "1"}
  assert topology.resolve(make_config().distributed, env).local_device_ids == (1,)


def test_without_cuda_visible_devices_the_node_gpu_count_decides():
  """No GPU gres: every task sees the node's GPUs (counted from /dev/nvidiaN)."""
  env = task_env(4, 3)
  dcfg = make_config().distributed
  assert topology.resolve(dcfg, env, gpu_count=lambda: 4).local_device_ids == (3,)
  with pytest.raises(topology.DistributedError, match=r"CUDA_VISIBLE_DEVICES=\(unset\) "
                     r"\(8 visible\), 4 tasks on this node"):
    topology.resolve(dcfg, env, gpu_count=lambda: 8)


def test_derived_port_mixes_in_the_step_id():
  port = topology.slurm_port
  assert port({"SLURM_JOB_ID": "1000"}) == port({"SLURM_JOB_ID": "5096"}) == 62440
  assert port({"SLURM_JOB_ID": "1000", "SLURM_STEP_ID": "1"}) == 61440 + (1000 + 1021) % 4096
  # the steps of one job all differ; step 1 of a job is not step 0 of the next job id
  assert len({port({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": str(s)}) for s in range(4096)}) == 4096
  assert port({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1"}) != port({"SLURM_JOB_ID": "8"})
  assert port({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "batch"}) == port({"SLURM_JOB_ID": "7"})
  assert port({"SLURM_JOB_ID": "7", "LMSCALE_COORDINATOR_PORT": "5000"}) == 5000
