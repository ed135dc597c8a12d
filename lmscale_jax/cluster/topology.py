"""Who the processes of a job are, from the config, ``LMSCALE_*`` variables or Slurm: pure.

:func:`resolve` reads settings and starts nothing (``distributed.initialize`` starts the runtime
from its :class:`Topology`). Each field (coordinator, number of processes, process id, local
device ids) comes from the first source that sets it:

  1. the config: ``--config.distributed.coordinator=host:port``, ``.num_processes``,
     ``.process_id``, ``.local_device_ids`` ("0,1");
  2. the environment: ``LMSCALE_COORDINATOR``, ``LMSCALE_NUM_PROCESSES``,
     ``LMSCALE_PROCESS_ID``, ``LMSCALE_LOCAL_DEVICE_IDS`` (what ``launch/*.sh`` set);
  3. Slurm (inside ``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``,
     ``SLURM_LOCALID``; the coordinator is the step's first node, port
     ``LMSCALE_COORDINATOR_PORT`` or one derived from the job and step ids (:func:`slurm_port`);
  4. nothing set: a single process (``jax.distributed`` is not started).

``distributed.mode="single"`` ignores all of it (e.g. a shell inside ``salloc``).

Slurm and devices (:func:`slurm_devices`): one task per node owns every GPU it sees; a task
Slurm bound GPUs to (``--gpus-per-task``, ``--gpu-bind``) owns those; tasks that all see the
node's GPUs take GPU ``SLURM_LOCALID`` only when there are as many GPUs as tasks; any other
layout is an error naming the variables, never a silent guess. JAX's own Slurm detection
assumes one task per GPU, so ``distributed.initialize`` switches it off and passes what this
module resolved.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any, Callable, Mapping

from lmscale_jax.errors import UserError

ENV_COORDINATOR = "LMSCALE_COORDINATOR"
ENV_NUM_PROCESSES = "LMSCALE_NUM_PROCESSES"
ENV_PROCESS_ID = "LMSCALE_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "LMSCALE_LOCAL_DEVICE_IDS"
ENV_COORDINATOR_PORT = "LMSCALE_COORDINATOR_PORT"
ENV_JOB_ID = "LMSCALE_JOB_ID"

# The fields that make a job multi-process; local_device_ids alone does not.
_JOB_FIELDS = ("coordinator", "num_processes", "process_id")
# Where to set each job field, for the message about an incomplete job.
_HOW_TO_SET = {"coordinator": f"{ENV_COORDINATOR} / --config.distributed.coordinator",
               "num_processes": f"{ENV_NUM_PROCESSES} / --config.distributed.num_processes",
               "process_id": f"{ENV_PROCESS_ID} / --config.distributed.process_id"}


class DistributedError(UserError, RuntimeError):
  """The processes of a job cannot be started or disagree about the job."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """This process's place in the job, before the runtime is started."""

  num_processes: int = 1
  process_id: int = 0
  coordinator: str | None = None
  local_device_ids: tuple[int, ...] | None = None
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict)  # field -> where from
  job: str = ""  # job_key(): tells this job's processes from another's at the same port

  @property
  def multi(self) -> bool:
    return self.num_processes > 1

  def describe_sources(self) -> str:
    """``"coordinator/num_processes from config, process_id from Slurm"``."""
    fields_by_source = collections.defaultdict(list)
    for field, source in self.sources.items():
      fields_by_source[source].append(field)
    return ", ".join(f"{'/'.join(fields)} from {source}"
                     for source, fields in fields_by_source.items()) or "defaults"


# --------------------------------------------------------------------------- Slurm
def expand_hostlist(hostlist: str) -> list[str]:
  """Slurm's compressed host list -> host names: ``gpu[01-03,07],login1`` -> gpu01, … login1.

  Handles several bracket groups per name (``r[1-2]n[01-02]``) and zero padding.
  """
  hosts: list[str] = []
  for item in _split_outside_brackets(hostlist.strip()):
    names = [""]
    for part in re.split(r"(\[[^\]]*\])", item):
      if not part:
        continue
      options = _expand_bracket(part[1:-1]) if part.startswith("[") else [part]
      names = [name + option for name in names for option in options]
    hosts += names
  return hosts


def _expand_bracket(ranges: str) -> list[str]:
  """``01-03,07`` -> 01, 02, 03, 07 (a range keeps the width of its first bound)."""
  out = []
  for span in ranges.split(","):
    if "-" in span:
      first, last = span.split("-", 1)
      out += [str(i).zfill(len(first)) for i in range(int(first), int(last) + 1)]
    else:
      out.append(span)
  return out


def _split_outside_brackets(text: str) -> list[str]:
  """Splits on the commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
  items, depth, current = [], 0, []
  for ch in text:
    if ch == "," and depth == 0:
      items.append("".join(current))
      current = []
      continue
    depth += ch == "["
    depth -= ch == "]"
    current.append(ch)
  items.append("".join(current))
  return [item for item in items if item]


def _tasks_per_node(spec: str, variable: str) -> list[int]:
  """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) -> [2, 2, 2, 1]."""
  counts = []
  for item in spec.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
    if not m:
      raise DistributedError(f"cannot parse Slurm tasks-per-node {variable}={spec!r} "
                             "(expected e.g. 2(x3),1)")
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts


# The derived port: JAX's range (jax/_src/clusters/slurm_cluster.py: the top 4096 ports of the
# ephemeral range), offset by the step: PORT_STEP_STRIDE is odd, so the 4096 steps of one job get
# 4096 different ports, and not 1, so step 1 of job j does not take step 0 of job j+1 (array
# jobs and sweeps have consecutive ids and share nodes).
PORT_BASE, PORT_RANGE, PORT_STEP_STRIDE = 65536 - 4096, 4096, 1021


def slurm_port(env: Mapping[str, str]) -> int:
  """The coordinator's port: ``LMSCALE_COORDINATOR_PORT``, else ``61440 + (SLURM_JOB_ID +
  1021 * SLURM_STEP_ID) % 4096`` (step 0: JAX's own choice). Two jobs can still derive the same
  port (job ids 4096 apart); process 0 then refuses to start
  (``lmscale_jax/cluster/rendezvous.py``)."""
  if env.get(ENV_COORDINATOR_PORT):
    return _parse_int(env[ENV_COORDINATOR_PORT], ENV_COORDINATOR_PORT)
  job = _parse_int(env.get("SLURM_JOB_ID") or "0", "SLURM_JOB_ID")
  step = env.get("SLURM_STEP_ID", "")
  step = int(step) if step.isdigit() else 0  # "batch"/"extern" steps run no training
  return PORT_BASE + (job + PORT_STEP_STRIDE * step) % PORT_RANGE


def job_key(env: Mapping[str, str]) -> str:
  """What tells this job's processes from another job's at the same coordinator address:
  ``LMSCALE_JOB_ID`` (launch/local.sh sets a random one), else Slurm's job and step ids."""
  if env.get(ENV_JOB_ID):
    return env[ENV_JOB_ID]
  if env.get("SLURM_JOB_ID"):
    return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
  return ""


def _tasks_on_this_node(env: Mapping[str, str], num_tasks: int, num_nodes: int) -> int:
  """How many tasks of the step share this node, from the most specific variable set."""
  for variable in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    if env.get(variable) and env.get("SLURM_NODEID", "").isdigit():
      per_node = _tasks_per_node(env[variable], variable)
      node = int(env["SLURM_NODEID"])
      if node < len(per_node):
        return per_node[node]
      break
  if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
    return int(env["SLURM_NTASKS_PER_NODE"])
  return -(-num_tasks // max(1, num_nodes))  # an even spread, rounded up


def slurm_fields(env: Mapping[str, str], devices: bool = True,
                 gpu_count: Callable[[], int] | None = None) -> dict[str, Any] | None:
  """The distributed fields a Slurm job step implies, or None outside ``srun``;
  ``local_device_ids`` (see :func:`slurm_devices`) only with ``devices``."""
  num_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
  in_step = all(env.get(k) for k in ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_LOCALID"))
  if not in_step or not num_tasks:
    return None
  nodes = expand_hostlist(env["SLURM_STEP_NODELIST"])
  fields: dict[str, Any] = {
      "coordinator": f"{nodes[0]}:{slurm_port(env)}",
      "num_processes": int(num_tasks),
      "process_id": int(env["SLURM_PROCID"]),
  }
  if devices:
    tasks = _tasks_on_this_node(env, int(num_tasks), len(nodes))
    ids = slurm_devices(env, tasks, gpu_count or (lambda: 0))
    if ids is not None:
      fields["local_device_ids"] = ids
  return fields


def _id_list(text: str | None) -> list[str] | None:
  """``CUDA_VISIBLE_DEVICES``-style list (None when unset); ``gpu:2`` style counts elsewhere."""
  if text is None:
    return None
  return [x for x in text.split(",") if x.strip()]


def _count(text: str | None) -> int | None:
  """``2`` or ``a100:2`` (``SLURM_GPUS_PER_TASK``, ``SLURM_GPUS_ON_NODE``) -> 2."""
  m = re.fullmatch(r"(?:[\w-]+:)?(\d+)", (text or "").strip())
  return int(m.group(1)) if m else None


def slurm_devices(env: Mapping[str, str], tasks: int, gpu_count: Callable[[], int]
                  ) -> tuple[int, ...] | None:
  """This task's devices (indices into what it sees), or None for every device it sees.

  ``tasks``: tasks of the step on this node. What the task sees: ``CUDA_VISIBLE_DEVICES`` (which
  Slurm sets per task, to its bound GPUs under ``--gpus-per-task``/``--gpu-bind``, else to all
  the step's GPUs on the node), or, unset, ``gpu_count()`` GPUs (no GPU gres: every task sees
  the node's GPUs). The node's GPUs of the step: ``SLURM_STEP_GPUS`` (ids) or
  ``SLURM_GPUS_ON_NODE``. The rules:

  * one task on the node, no GPU visible, or ``JAX_PLATFORMS`` without ``cuda``/``gpu``:
    everything it sees (None);
  * Slurm gave this task a share of the node's GPUs (fewer visible than the node has, and the
    tasks' shares add up to the node's GPUs, or ``SLURM_GPUS_PER_TASK`` equals the share): all
    of its share (None);
  * every task sees the node's GPUs and there are exactly as many as tasks: GPU
    ``SLURM_LOCALID`` (one task per GPU);
  * a single GPU visible and the node's count unknown: that GPU (None);
  * anything else (shares that overlap, as ``--gpu-bind=closest`` gives; more or fewer GPUs
    than tasks with no binding) is ambiguous: a :class:`DistributedError` naming the variables.
  """
  platforms = env.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu")):
    return None  # e.g. JAX_PLATFORMS=cpu: no GPU is used, whatever the node has
  visible = _id_list(env.get("CUDA_VISIBLE_DEVICES"))
  seen = len(visible) if visible is not None else gpu_count()
  if tasks <= 1 or seen == 0:
    return None
  step_gpus = _id_list(env.get("SLURM_STEP_GPUS"))
  node = len(step_gpus) if step_gpus is not None else _count(env.get("SLURM_GPUS_ON_NODE"))
  per_task = _count(env.get("SLURM_GPUS_PER_TASK"))
  local_id = _parse_int(env["SLURM_LOCALID"], "SLURM_LOCALID")
  if visible is not None and node is not None and seen < node:
    if seen * tasks == node or per_task == seen:
      return None  # this task's own share, bound by Slurm
  elif seen == tasks and (node is None or node == seen):
    if 0 <= local_id < seen:
      return (local_id,)
  elif seen == 1 and node is None:
    return None
  raise DistributedError(
      f"cannot tell which GPUs are this task's: SLURM_LOCALID={local_id}, "
      f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '(unset)')!s} ({seen} visible), "
      f"{tasks} tasks on this node (SLURM_STEP_TASKS_PER_NODE="
      f"{env.get('SLURM_STEP_TASKS_PER_NODE', env.get('SLURM_TASKS_PER_NODE', '(unset)'))}), "
      f"SLURM_STEP_GPUS={env.get('SLURM_STEP_GPUS', '(unset)')}, SLURM_GPUS_ON_NODE="
      f"{env.get('SLURM_GPUS_ON_NODE', '(unset)')}, SLURM_GPUS_PER_TASK="
      f"{env.get('SLURM_GPUS_PER_TASK', '(unset)')}. Submit one task per GPU "
      "(--ntasks-per-node=GPUs), one per node (--ntasks-per-node=1), or --gpus-per-task=K so "
      f"Slurm binds each task its GPUs; or set {ENV_LOCAL_DEVICE_IDS}")


def visible_gpu_count() -> int:
  """NVIDIA GPUs this node has (``/dev/nvidiaN``): what a task sees when Slurm set no
  ``CUDA_VISIBLE_DEVICES``. Reads ``/dev`` only, so resolving still starts nothing."""
  try:
    return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
  except OSError:
    return 0


# --------------------------------------------------------------------------- resolution
def _parse_ids(text: str, where: str) -> tuple[int, ...] | None:
  text = str(text).strip()
  if not text:
    return None
  try:
    ids = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise DistributedError(
        f"{where}={text!r}: expected comma-separated device ids, e.g. 0,1") from None
  if any(i < 0 for i in ids):
    raise DistributedError(f"{where}={text!r}: device ids must be >= 0")
  return ids


def _parse_int(text: str, where: str) -> int:
  try:
    return int(str(text).strip())
  except ValueError:
    raise DistributedError(f"{where}={text!r}: expected an integer") from None


def _config_fields(dcfg) -> dict[str, Any]:
  """The fields ``config.distributed`` sets (0 / -1 / "" mean unset)."""
  fields: dict[str, Any] = {}
  if str(dcfg.coordinator):
    fields["coordinator"] = str(dcfg.coordinator)
  if int(dcfg.num_processes) > 0:
    fields["num_processes"] = int(dcfg.num_processes)
  if int(dcfg.process_id) >= 0:
    fields["process_id"] = int(dcfg.process_id)
  ids = _parse_ids(dcfg.local_device_ids, "distributed.local_device_ids")
  if ids is not None:
    fields["local_device_ids"] = ids
  return fields


def _env_fields(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
  """The fields the ``LMSCALE_*`` variables set: field -> (value, variable)."""
  fields: dict[str, tuple[Any, str]] = {}
  if env.get(ENV_COORDINATOR):
    fields["coordinator"] = (env[ENV_COORDINATOR], ENV_COORDINATOR)
  for field, variable in (("num_processes", ENV_NUM_PROCESSES), ("process_id", ENV_PROCESS_ID)):
    if env.get(variable):
      fields[field] = (_parse_int(env[variable], variable), variable)
  ids = _parse_ids(env.get(ENV_LOCAL_DEVICE_IDS, ""), ENV_LOCAL_DEVICE_IDS)
  if ids is not None:
    fields["local_device_ids"] = (ids, ENV_LOCAL_DEVICE_IDS)
  return fields


def _collect(dcfg, env: Mapping[str, str], gpu_count: Callable[[], int]
             ) -> tuple[dict[str, Any], dict[str, str]]:
  """Each field from the first source that sets it: (values, field -> source)."""
  values: dict[str, Any] = {}
  sources: dict[str, str] = {}

  def take(field, value, source):
    if field not in values:
      values[field], sources[field] = value, source

  for field, value in _config_fields(dcfg).items():
    take(field, value, "config")
  for field, (value, variable) in _env_fields(env).items():
    take(field, value, variable)
  # Slurm only fills what is still unset: LMSCALE_* can override it, e.g. the coordinator.
  if any(f not in values for f in _JOB_FIELDS):
    # Slurm's device choice only when nothing names the devices (it may be ambiguous).
    fields = slurm_fields(env, devices="local_device_ids" not in values, gpu_count=gpu_count)
    for field, value in (fields or {}).items():
      take(field, value, "Slurm")
  return values, sources


def resolve(dcfg, env: Mapping[str, str] | None = None,
            gpu_count: Callable[[], int] | None = None) -> Topology:
  """The topology the config (``config.distributed``) and environment describe.

  Pure: reads ``env`` (default ``os.environ``) and, for a Slurm task without
  ``CUDA_VISIBLE_DEVICES``, ``gpu_count()`` (default: this node's ``/dev/nvidiaN`` for the real
  environment, 0 for a given ``env``); starts nothing. Bad, incomplete or ambiguous settings
  raise :class:`DistributedError` naming the variables involved.
  """
  if gpu_count is None:
    gpu_count = visible_gpu_count if env is None else (lambda: 0)
  env = os.environ if env is None else env
  mode = str(dcfg.mode)
  if mode not in ("auto", "single"):
    raise DistributedError(f"distributed.mode={mode!r}: expected 'auto' or 'single'")
  if mode == "single":
    return Topology(sources={"all": "distributed.mode=single"})
  values, sources = _collect(dcfg, env, gpu_count)
  num_processes = values.get("num_processes")
  if num_processes is not None and num_processes < 1:
    raise DistributedError(f"number of processes {num_processes} (from "
                           f"{sources['num_processes']}) must be >= 1")
  if not any(f in values for f in _JOB_FIELDS) or num_processes == 1:
    return _single_process(values, sources)
  return dataclasses.replace(_multi_process(values, sources), job=job_key(env))


def _single_process(values: dict[str, Any], sources: dict[str, str]) -> Topology:
  process_id = values.get("process_id", 0)
  if process_id != 0:
    raise DistributedError(f"process id {process_id} (from {sources['process_id']}) in a "
                           "1-process job: expected 0")
  return Topology(local_device_ids=values.get("local_device_ids"), sources=sources)


def _multi_process(values: dict[str, Any], sources: dict[str, str]) -> Topology:
  missing = [f for f in _JOB_FIELDS if f not in values]
  if missing:
    given = ", ".join(f"{f} from {sources[f]}" for f in values if f != "local_device_ids")
    raise DistributedError(
        f"incomplete multi-process settings: {given}, but no "
        + " and no ".join(f"{f} ({_HOW_TO_SET[f]})" for f in missing))
  coordinator, process_id = values["coordinator"], values["process_id"]
  num_processes = values["num_processes"]
  m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[^:\s]+):(\d+)", coordinator)
  if not m or not 0 < int(m.group(2)) < 65536:
    raise DistributedError(f"coordinator {coordinator!r} (from {sources['coordinator']}): "
                           "expected host:port, e.g. node001:12355")
  if not 0 <= process_id < num_processes:
    raise DistributedError(
        f"process id {process_id} (from {sources['process_id']}) is not in "
        f"[0, {num_processes}) for a job of {num_processes} processes (from "
        f"{sources['num_processes']}): ids must be 0 … {num_processes - 1}, each used once")
  return Topology(num_processes=num_processes, process_id=process_id, coordinator=coordinator,
                  local_device_ids=values.get("local_device_ids"), sources=sources)
