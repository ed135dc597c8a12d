"""Multi-controller start-up (``jax.distributed``) and the checks that keep processes in step.

Who the processes are is resolved per field (coordinator, number of processes, process id,
local device ids), from the first source that sets it:

  1. the config: ``--config.distributed.coordinator=host:port``, ``.num_processes``,
     ``.process_id``, ``.local_device_ids`` ("0,1");
  2. the environment: ``LMSCALE_COORDINATOR``, ``LMSCALE_NUM_PROCESSES``,
     ``LMSCALE_PROCESS_ID``, ``LMSCALE_LOCAL_DEVICE_IDS`` (what ``launch/*.sh`` set);
  3. Slurm (inside ``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``,
     ``SLURM_LOCALID``; the coordinator is the step's first node, port
     ``LMSCALE_COORDINATOR_PORT`` or one derived from the job id;
  4. nothing set: a single process (``jax.distributed`` is not started).

``distributed.mode="single"`` ignores all of it (e.g. a shell inside ``salloc``).

Slurm and devices: with one task per node the task owns all its GPUs; with several tasks on a
node each takes GPU ``SLURM_LOCALID``, unless Slurm already bound one GPU per task
(``--gpus-per-task=1`` / ``--gpu-bind``: ``CUDA_VISIBLE_DEVICES`` lists one device). JAX's own
Slurm detection assumes one task per GPU; it is switched off here
(``cluster_detection_method="deactivate"``) so both layouts work.

Failure behaviour. The runtime's heartbeat (``distributed.heartbeat_timeout``) makes every
process abort when one dies. A Python exception in one process must not wait for the others:
JAX's exit hook waits in a shutdown barrier (``shutdown_timeout``) while its peers wait in a
collective, so ``main.py`` ends a failed multi-process run with ``os._exit`` (:func:`exit_now`),
and the peers then stop within the heartbeat timeout. Start-up that does not complete within
``distributed.initialization_timeout`` ends with one line naming the coordinator (a watchdog:
the runtime itself would abort with a bare ``DEADLINE_EXCEEDED``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Mapping

from absl import logging

ENV_COORDINATOR = "LMSCALE_COORDINATOR"
ENV_NUM_PROCESSES = "LMSCALE_NUM_PROCESSES"
ENV_PROCESS_ID = "LMSCALE_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "LMSCALE_LOCAL_DEVICE_IDS"
ENV_COORDINATOR_PORT = "LMSCALE_COORDINATOR_PORT"

# Extra seconds the runtime gets beyond our own start-up watchdog, so that ours (with a message
# naming the coordinator) fires first.
_RUNTIME_GRACE_S = 15
# Key-value exchanges after start-up are quick (every process is already connected); this only
# bounds how long a process waits for a peer that is busy elsewhere (e.g. staging) in
# :func:`agree` calls that pass no timeout.
_DEFAULT_EXCHANGE_TIMEOUT_S = 600
_SHARED_CHECK_FILE = ".lmscale_shared_check"
_COORDINATOR_LINGER_S = 2.0


class DistributedError(RuntimeError):
  """The processes of a job cannot be started or disagree about the job."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """This process's place in the job, before the runtime is started."""

  num_processes: int = 1
  process_id: int = 0
  coordinator: str | None = None
  local_device_ids: tuple[int, ...] | None = None
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict)  # field -> where from

  @property
  def multi(self) -> bool:
    return self.num_processes > 1

  def describe_sources(self) -> str:
    by = collections.defaultdict(list)
    for field, src in self.sources.items():
      by[src].append(field)
    return ", ".join(f"{'/'.join(v)} from {k}" for k, v in by.items()) or "defaults"


# --------------------------------------------------------------------------- Slurm
def expand_hostlist(hostlist: str) -> list[str]:
  """Slurm's compressed host list -> host names: ``gpu[01-03,07],login1`` -> gpu01, … login1.

  Handles several bracket groups per name (``r[1-2]n[01-02]``) and zero padding.
  """
  hosts: list[str] = []
  for item in _split_top_level(hostlist.strip()):
    parts = re.split(r"(\[[^\]]*\])", item)
    names = [""]
    for part in parts:
      if not part:
        continue
      if part.startswith("["):
        options = []
        for rng in part[1:-1].split(","):
          if "-" in rng:
            lo, hi = rng.split("-", 1)
            width = len(lo)
            options += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
          else:
            options.append(rng)
        names = [n + o for n in names for o in options]
      else:
        names = [n + part for n in names]
    hosts += names
  return hosts


def _split_top_level(s: str) -> list[str]:
  """Splits on commas outside brackets."""
  out, depth, cur = [], 0, []
  for ch in s:
    if ch == "," and depth == 0:
      out.append("".join(cur))
      cur = []
      continue
    depth += ch == "["
    depth -= ch == "]"
    cur.append(ch)
  if cur:
    out.append("".join(cur))
  return [x for x in out if x]


def _tasks_per_node(spec: str) -> list[int]:
  """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) -> [2, 2, 2, 1]."""
  out = []
  for item in spec.split(","):
    m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
    if not m:
      raise DistributedError(f"cannot parse Slurm tasks-per-node {spec!r}")
    out += [int(m.group(1))] * int(m.group(2) or 1)
  return out


def slurm_port(env: Mapping[str, str]) -> int:
  if env.get(ENV_COORDINATOR_PORT):
    return int(env[ENV_COORDINATOR_PORT])
  # JAX's own choice (jax/_src/clusters/slurm_cluster.py): a job-specific port in the top
  # 4096 of the ephemeral range, so concurrent jobs sharing a first node do not collide.
  return int(env.get("SLURM_JOB_ID", "0")) % 4096 + (65535 - 4096 + 1)


def slurm_fields(env: Mapping[str, str]) -> dict[str, Any] | None:
  """The distributed fields a Slurm job step implies, or None outside ``srun``."""
  ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
  if not all(env.get(k) for k in ("SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_LOCALID")) \
      or not ntasks:
    return None
  nodes = expand_hostlist(env["SLURM_STEP_NODELIST"])
  fields: dict[str, Any] = {
      "coordinator": f"{nodes[0]}:{slurm_port(env)}",
      "num_processes": int(ntasks),
      "process_id": int(env["SLURM_PROCID"]),
  }
  here = None
  spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
  if spec and env.get("SLURM_NODEID", "").isdigit():
    per_node = _tasks_per_node(spec)
    node = int(env["SLURM_NODEID"])
    here = per_node[node] if node < len(per_node) else None
  if here is None and env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
    here = int(env["SLURM_NTASKS_PER_NODE"])
  if here is None:
    here = -(-int(ntasks) // max(1, len(nodes)))
  visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
  if here > 1 and len(visible) != 1:
    # Several tasks share the node's GPUs: task k takes local GPU k.
    fields["local_device_ids"] = (int(env["SLURM_LOCALID"]),)
  # else: one task per node owns every GPU it sees, or Slurm bound one GPU to this task.
  return fields


# --------------------------------------------------------------------------- resolution
def _parse_ids(text: str, where: str) -> tuple[int, ...] | None:
  text = str(text).strip()
  if not text:
    return None
  try:
    ids = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise DistributedError(f"{where}={text!r}: expected comma-separated device ids, e.g. 0,1")
  if any(i < 0 for i in ids):
    raise DistributedError(f"{where}={text!r}: device ids must be >= 0")
  return ids


def _parse_int(text: str, where: str) -> int:
  try:
    return int(str(text).strip())
  except ValueError:
    raise DistributedError(f"{where}={text!r}: expected an integer") from None


def resolve(dcfg, env: Mapping[str, str] | None = None) -> Topology:
  """The topology the config (``config.distributed``) and environment describe.

  Pure: reads ``env`` (default ``os.environ``), starts nothing; bad or incomplete settings
  raise :class:`DistributedError` naming the variables involved.
  """
  env = os.environ if env is None else env
  mode = str(dcfg.get("mode", "auto"))
  if mode not in ("auto", "single"):
    raise DistributedError(f"distributed.mode={mode!r}: expected 'auto' or 'single'")
  if mode == "single":
    return Topology(sources={"all": "distributed.mode=single"})

  fields: dict[str, Any] = {}
  sources: dict[str, str] = {}

  def take(field, value, source):
    if field not in fields and value is not None:
      fields[field], sources[field] = value, source

  # 1. config
  if str(dcfg.get("coordinator", "")):
    take("coordinator", str(dcfg.coordinator), "config")
  if int(dcfg.get("num_processes", 0)) > 0:
    take("num_processes", int(dcfg.num_processes), "config")
  if int(dcfg.get("process_id", -1)) >= 0:
    take("process_id", int(dcfg.process_id), "config")
  take("local_device_ids",
       _parse_ids(dcfg.get("local_device_ids", ""), "distributed.local_device_ids"), "config")
  # 2. environment
  if env.get(ENV_COORDINATOR):
    take("coordinator", env[ENV_COORDINATOR], ENV_COORDINATOR)
  if env.get(ENV_NUM_PROCESSES):
    take("num_processes", _parse_int(env[ENV_NUM_PROCESSES], ENV_NUM_PROCESSES),
         ENV_NUM_PROCESSES)
  if env.get(ENV_PROCESS_ID):
    take("process_id", _parse_int(env[ENV_PROCESS_ID], ENV_PROCESS_ID), ENV_PROCESS_ID)
  take("local_device_ids", _parse_ids(env.get(ENV_LOCAL_DEVICE_IDS, ""), ENV_LOCAL_DEVICE_IDS),
       ENV_LOCAL_DEVICE_IDS)
  # 3. Slurm (only fills what is still unset: LMSCALE_* can override, e.g. the coordinator)
  if any(f not in fields for f in ("coordinator", "num_processes", "process_id")):
    slurm = slurm_fields(env)
    if slurm is not None:
      for k, v in slurm.items():
        take(k, v, "Slurm")

  n = fields.get("num_processes")
  if n is not None and n < 1:
    raise DistributedError(f"number of processes {n} (from {sources['num_processes']}) must "
                           "be >= 1")
  # 4. a single process
  if not any(f in fields for f in ("coordinator", "num_processes", "process_id")) or n == 1:
    pid = fields.get("process_id", 0)
    if pid not in (0, None):
      raise DistributedError(f"process id {pid} (from {sources['process_id']}) in a "
                             "1-process job: expected 0")
    return Topology(local_device_ids=fields.get("local_device_ids"), sources=sources)

  missing = [f for f in ("coordinator", "num_processes", "process_id") if f not in fields]
  if missing:
    hints = {"coordinator": f"{ENV_COORDINATOR} / --config.distributed.coordinator",
             "num_processes": f"{ENV_NUM_PROCESSES} / --config.distributed.num_processes",
             "process_id": f"{ENV_PROCESS_ID} / --config.distributed.process_id"}
    given = ", ".join(f"{f} from {sources[f]}" for f in fields if f != "local_device_ids")
    raise DistributedError(
        f"incomplete multi-process settings: {given}, but no "
        + " and no ".join(f"{f} ({hints[f]})" for f in missing))
  coordinator, pid = fields["coordinator"], fields["process_id"]
  m = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[^:\s]+):(\d+)", coordinator)
  if not m or not 0 < int(m.group(2)) < 65536:
    raise DistributedError(f"coordinator {coordinator!r} (from {sources['coordinator']}): "
                           "expected host:port, e.g. node001:12355")
  if not 0 <= pid < n:
    raise DistributedError(
        f"process id {pid} (from {sources['process_id']}) is not in [0, {n}) for a job of {n} "
        f"processes (from {sources['num_processes']}): ids must be 0 … {n - 1}, each used once")
  return Topology(num_processes=n, process_id=pid, coordinator=coordinator,
                  local_device_ids=fields.get("local_device_ids"), sources=sources)


# --------------------------------------------------------------------------- start-up
def _probe(address: str, timeout: float = 2.0) -> str | None:
  """None when a TCP connection to host:port succeeds, else the reason."""
  host, port = address.rsplit(":", 1)
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
      return None
  except OSError as e:
    return e.strerror or str(e)


def _startup_failure(topo: Topology, timeout: int) -> str:
  head = (f"distributed start-up did not complete within {timeout} s "
          f"(distributed.initialization_timeout): process {topo.process_id} of "
          f"{topo.num_processes}, coordinator {topo.coordinator}")
  if topo.process_id != 0:
    why = _probe(topo.coordinator)
    if why is not None:
      return (f"{head}: cannot reach the coordinator {topo.coordinator} ({why}). Is process 0 "
              "running there, is the host name/port right, and is the port open from this "
              "node?")
  return (f"{head}: not all {topo.num_processes} processes registered with the coordinator. "
          "A process did not start, or the processes disagree about the job (every process "
          f"needs the same coordinator and process count, and a distinct id in "
          f"[0, {topo.num_processes})). Settings here: {topo.describe_sources()}")


def initialize(config) -> Topology:
  """Starts the JAX runtime for this process (a no-op for a single process); returns its place.

  Must run before anything initialises a JAX backend (``jax.devices()`` …), never at import
  time (Grain's worker processes re-import ``__main__``). After start-up, checks that all
  processes agree on the job and have the same number of devices; process 0 logs the topology.
  """
  import jax

  d = config.distributed
  topo = resolve(d)
  if not topo.multi:
    if topo.local_device_ids:
      jax.config.update("jax_cuda_visible_devices", ",".join(map(str, topo.local_device_ids)))
    log_topology(topo)
    return topo
  if jax.distributed.is_initialized():
    return topo
  # Collectives between CPU devices of different processes (tests, local.sh on CPU) need an
  # implementation: named explicitly rather than relying on this JAX version's default.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Its sync manager is how the processes agree on a step to checkpoint at when preempted
  # (lmscale_jax/preemption.py); on by default, required here.
  jax.config.update("jax_enable_preemption_service", True)
  timeout = int(d.initialization_timeout)
  if timeout <= 0 or int(d.heartbeat_timeout) <= 0:
    raise DistributedError("distributed.initialization_timeout and heartbeat_timeout must be "
                           "positive (seconds)")
  done = threading.Event()

  def watchdog():
    if not done.wait(timeout):
      print(f"error: {_startup_failure(topo, timeout)}", file=sys.stderr, flush=True)
      os._exit(1)

  threading.Thread(target=watchdog, name="lmscale-init-watchdog", daemon=True).start()
  logging.info("process %d of %d: connecting to coordinator %s (%s)", topo.process_id,
               topo.num_processes, topo.coordinator, topo.describe_sources())
  try:
    jax.distributed.initialize(
        coordinator_address=topo.coordinator, num_processes=topo.num_processes,
        process_id=topo.process_id,
        local_device_ids=list(topo.local_device_ids) if topo.local_device_ids else None,
        cluster_detection_method="deactivate",
        initialization_timeout=timeout + _RUNTIME_GRACE_S,
        heartbeat_timeout_seconds=int(d.heartbeat_timeout),
        shutdown_timeout_seconds=int(d.shutdown_timeout))
  finally:
    done.set()
  global _coordinator
  _coordinator = topo.coordinator
  _check_job(topo)
  log_topology(topo)
  return topo


def _check_job(topo: Topology) -> None:
  """Every process declared the same job; every process has the same number of devices."""
  import jax

  declared = allgather("declared", json.dumps(
      {"n": topo.num_processes, "id": topo.process_id, "host": socket.gethostname(),
       "sources": topo.describe_sources()}), timeout_s=60)
  decl = [json.loads(x) for x in declared]
  _hosts[:] = [x["host"] for x in decl]
  bad = [(i, x) for i, x in enumerate(decl) if x["n"] != decl[0]["n"] or x["id"] != i]
  if bad or jax.process_count() != topo.num_processes:
    lines = "; ".join(f"process {i} on {x['host']} says {x['n']} processes, id {x['id']} "
                      f"({x['sources']})" for i, x in enumerate(decl))
    raise DistributedError(f"the processes disagree about the job: {lines}")
  counts = collections.Counter(dev.process_index for dev in jax.devices())
  if len(set(counts.values())) != 1:
    desc = ", ".join(f"process {p}: {c}" for p, c in sorted(counts.items()))
    raise DistributedError(
        f"processes have different numbers of devices ({desc}); every process must drive the "
        "same number (local_device_ids / one task per GPU or per node, not a mix)")


def log_topology(topo: Topology) -> None:
  import jax

  if jax.process_index() != 0:
    return
  devices = jax.devices()
  per = jax.local_device_count()
  logging.info(
      "topology: %d process%s × %d %s device%s = %d global device%s; mesh {'data': %d}; %s",
      jax.process_count(), "es" if jax.process_count() > 1 else "", per, devices[0].platform,
      "s" if per > 1 else "", len(devices), "s" if len(devices) > 1 else "", len(devices),
      f"coordinator {topo.coordinator} ({topo.describe_sources()})" if topo.multi
      else "single process")


# --------------------------------------------------------------------------- agreement
def _client():
  from jax._src import distributed as jd  # the runtime's key-value store client

  if jd.global_state.client is None:
    raise DistributedError("jax.distributed is not initialized")
  return jd.global_state.client


_exchange_round = collections.Counter()


def allgather(name: str, value: str, timeout_s: float = _DEFAULT_EXCHANGE_TIMEOUT_S) -> list[str]:
  """Every process's ``value`` (a string), in process order, via the coordinator's key-value
  store. Single process: ``[value]``. Every process must call it with the same ``name``s in
  the same order (a per-name counter keeps repeated names apart)."""
  import jax

  if jax.process_count() == 1:
    return [value]
  _exchange_round[name] += 1
  key = f"lmscale/{name}/{_exchange_round[name]}"
  client = _client()
  client.key_value_set(f"{key}/{jax.process_index()}", value)
  out = []
  for p in range(jax.process_count()):
    try:
      out.append(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
    except Exception as e:  # the runtime raises a bare XlaRuntimeError on a deadline
      raise DistributedError(f"no answer from process {p} for {name!r} within {timeout_s:.0f} "
                             f"s: {e}") from e
  return out


def agree(name: str, fn: Callable[[], Any], timeout_s: float = _DEFAULT_EXCHANGE_TIMEOUT_S):
  """Runs ``fn`` in every process; if it fails anywhere, every process raises: the failing
  one its own error, the others one naming each failed process, its host and its error.

  Without this a check failing on one node only (its local dataset, its view of the workdir)
  would leave the other processes waiting in the first collective until the heartbeat
  timeout, with an error that names nothing.
  """
  import jax

  try:
    result, error = fn(), None
  except Exception as e:  # re-raised below, identically in every process
    result, error = None, e
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return result
  msg = "" if error is None else f"{type(error).__name__}: {error}"
  answers = allgather(f"agree/{name}", json.dumps({"error": msg, "host": socket.gethostname()}),
                      timeout_s)
  failed = [(p, json.loads(a)) for p, a in enumerate(answers) if json.loads(a)["error"]]
  if failed:
    if error is not None and len(failed) == 1:
      raise error
    desc = "; ".join(f"process {p} on {a['host']}: {a['error']}" for p, a in failed)
    raise DistributedError(f"{name} failed in {len(failed)} of {jax.process_count()} "
                           f"processes: {desc}")
  return result


# --------------------------------------------------------------------------- preflight
# Config keys that may differ between processes without changing what they compute.
PER_PROCESS_KEYS = ("distributed", "data.path", "data.workers", "data.prefetch_buffer",
                    "data.read_threads", "data.stage_from", "data.stage_workers")


def comparable_config(config) -> dict:
  c = json.loads(config.to_json_best_effort())
  for key in PER_PROCESS_KEYS:
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node.get(p, {})
    node.pop(leaf, None)
  return c


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _latest_checkpoint(workdir: str) -> int | None:
  # Orbax writes a step under a temporary name and renames it to the bare number when
  # complete, so only all-digit entries are checkpoints.
  d = os.path.join(workdir, "checkpoints")
  steps = [int(x) for x in os.listdir(d) if x.isdigit()] if os.path.isdir(d) else []
  return max(steps) if steps else None


def _check_checkpoint_processes(workdir: str, n_proc: int) -> None:
  latest = _latest_checkpoint(workdir)
  if latest is None:
    return
  data_dir = os.path.join(workdir, "checkpoints", str(latest), "data")
  written = sorted(os.listdir(data_dir)) if os.path.isdir(data_dir) else []
  counts = {m.group(1) for f in written if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", f))}
  if counts and counts != {str(n_proc)}:
    raise DistributedError(
        f"{workdir}/checkpoints/{latest} was written by {'/'.join(sorted(counts))} "
        f"process(es); this job has {n_proc}. The data iterator state is per process: resume "
        "with the same number of processes (or start a new workdir)")


def preflight(config, workdir: str) -> None:
  """Checks, before any data is read, that the processes will run the same steps together:
  a batch divisible by the global devices, identical configs, one shared workdir, and a
  checkpoint (if any) written by the same number of processes. Any failure is raised in every
  process with the process and host it concerns."""
  import jax

  n_dev, n_proc = jax.device_count(), jax.process_count()
  batch = int(config.train.batch_size)
  if batch % n_dev:
    raise DistributedError(
        f"train.batch_size={batch} is not divisible by the {n_dev} global devices "
        f"({n_proc} process{'es' if n_proc > 1 else ''} × {jax.local_device_count()}): every "
        "device must get the same number of rows")
  if n_proc == 1:
    _check_checkpoint_processes(workdir, 1)
    return
  mine = _flatten(comparable_config(config))
  configs = [json.loads(x) for x in allgather("config", json.dumps(mine, sort_keys=True))]
  for p, other in enumerate(configs):
    diff = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
    if diff:
      k = diff[0]
      raise DistributedError(
          f"the processes were started with different configs: process "
          f"{jax.process_index()} has {k}={mine.get(k)!r}, process {p} has "
          f"{k}={other.get(k)!r}" + (f" (and {len(diff) - 1} more keys)" if len(diff) > 1
                                     else "") + "; they would run different steps")

  token = allgather("workdir_token", uuid.uuid4().hex if jax.process_index() == 0 else "")[0]
  check = os.path.join(workdir, _SHARED_CHECK_FILE)

  def write_token():
    if jax.process_index() == 0:
      os.makedirs(workdir, exist_ok=True)
      with open(check, "w") as f:
        f.write(token)

  agree("workdir", write_token)

  def read_token():
    try:
      with open(check) as f:
        seen = "another run's token" if f.read() != token else None
    except OSError as e:
      seen = f"unreadable: {e.strerror}"
    if seen:
      raise DistributedError(
          f"workdir {workdir} is not the same directory on every process (process 0 wrote "
          f"{check}; here it is {seen}): checkpoints and metrics need a shared file system "
          "visible to all nodes")

  agree("shared workdir", read_token)
  agree("checkpoint", lambda: _check_checkpoint_processes(workdir, n_proc))


# --------------------------------------------------------------------------- exits
_hosts: list[str] = []  # host of every process, from start-up
_coordinator: str | None = None


def lost_processes(timeout_s: float) -> list[int] | None:
  """The processes the runtime no longer counts as alive, or None if it cannot tell within
  ``timeout_s``.

  ``get_live_nodes`` answers once every live process has asked (the others are on the same
  failure path) and a dead one has missed its heartbeat, so this takes up to
  ``heartbeat_timeout``; it runs in a thread because it may also never answer (a peer still
  blocked in a collective, or the coordinator itself gone).
  """
  import jax

  n = jax.process_count()
  out: list = []

  def ask():
    try:
      out.append(sorted(set(range(n)) - set(_client().get_live_nodes(list(range(n))))))
    except Exception:  # the coordinator is gone (process 0 lost), or the runtime is closing
      pass

  t = threading.Thread(target=ask, name="lmscale-live-nodes", daemon=True)
  t.start()
  t.join(timeout_s)
  return out[0] if out else None


def coordinator_gone() -> str | None:
  """A line naming process 0 if its coordination service no longer accepts connections."""
  import jax

  if _coordinator is None or jax.process_index() == 0 or _probe(_coordinator, 0.5) is None:
    return None
  host = f" on {_hosts[0]}" if _hosts else ""
  return (f"lost process 0{host} (the coordinator, {_coordinator}): it stopped (crashed, "
          "killed, or its node failed); every process stops. Rerun the job: it resumes from "
          "the last checkpoint")


def explain_collective_failure(heartbeat_timeout_s: float) -> str:
  """One line for a process whose collective failed: which peer was lost, if known."""
  lost = lost_processes(heartbeat_timeout_s + 5)
  if lost:
    where = ", ".join(f"process {p}" + (f" on {_hosts[p]}" if p < len(_hosts) else "")
                      for p in lost)
    return (f"lost {where}: it stopped (crashed, killed, or its node failed); this process "
            "stops too. Rerun the job: it resumes from the last checkpoint")
  return ("a collective failed and the runtime could not say which process was lost; see "
          "the other processes' logs")


def exit_now(code: int = 1) -> None:
  """Ends a failed multi-process run at once, skipping JAX's shutdown barrier (its peers are
  blocked in a collective and would otherwise hold this process for ``shutdown_timeout``)."""
  import jax

  try:
    logging.flush()
  except Exception:  # flushing is best effort on the way out
    pass
  sys.stdout.flush()
  sys.stderr.flush()
  if jax.distributed.is_initialized() and jax.process_index() == 0:
    # Process 0 hosts the coordination service: when it goes, the runtime aborts every other
    # process at once. A moment's wait lets peers that failed the same check print why.
    time.sleep(_COORDINATOR_LINGER_S)
  os._exit(code)
