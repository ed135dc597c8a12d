"""The multi-controller runtime (``jax.distributed``): start-up, agreement, exits.

Who the processes are is resolved by :mod:`lmscale_jax.cluster.topology` (config >
``LMSCALE_*`` > Slurm > single); this module owns what they do together once that is known
(what they check before reading data is :mod:`lmscale_jax.train.preflight`):

* start-up (:func:`initialize`): starts the runtime with that topology, under a watchdog, then
  checks that every process declared the same job and has the same number of devices;
* agreement (:func:`allgather`, :func:`agree`): exchanges through the coordinator's key-value
  store, so that a check failing in one process fails in all of them, naming it;
* exits (:func:`exit_now`, :func:`await_runtime`): how a failed process leaves.

Failure behaviour. The runtime's heartbeat (``distributed.heartbeat_timeout``) ends every
process when one is lost; :mod:`lmscale_jax.cluster.supervisor` (a parent process, forked before the
runtime starts) turns that abort into one line naming the lost process and its host, and exit
75. A Python exception in one process must not wait for the others: JAX's exit hook waits in a
shutdown barrier (``shutdown_timeout``) while its peers wait in a collective, so ``main.py``
ends a failed multi-process run with ``os._exit`` (:func:`exit_now`), and the peers then stop
within the heartbeat timeout. A collective that fails because a peer is gone waits for the
runtime's verdict (:func:`await_runtime`) instead of reporting a bare transport error. Start-up
that does not complete within ``distributed.initialization_timeout`` ends with one line naming
the coordinator (a watchdog: the runtime itself would abort with a bare ``DEADLINE_EXCEEDED``).
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
from typing import Any, Callable

import jax
from absl import logging

from lmscale_jax.cluster import rendezvous, supervisor
from lmscale_jax.cluster.topology import DistributedError, Topology, resolve
from lmscale_jax.errors import UserError

# Extra seconds the runtime gets beyond our own start-up watchdog, so that ours (with a message
# naming the coordinator) fires first.
_RUNTIME_GRACE_S = 15
# Key-value exchanges after start-up are quick (every process is already connected); this only
# bounds how long a process waits for a peer that is busy elsewhere (e.g. staging) in
# :func:`agree` calls that pass no timeout.
_DEFAULT_EXCHANGE_TIMEOUT_S = 600
# The start-up job check waits for peers that have just connected, not for work.
_JOB_CHECK_TIMEOUT_S = 60
# How long process 0 (the coordination service) stays up after a failure: see exit_now.
_COORDINATOR_LINGER_S = 2.0


@dataclasses.dataclass
class _Job:
  """What start-up learnt about the other processes."""

  coordinator: str | None = None
  hosts: list[str] = dataclasses.field(default_factory=list)  # by process id


_job = _Job()


# --------------------------------------------------------------------------- start-up
def _startup_failure(topo: Topology, timeout: int) -> str:
  head = (f"distributed start-up did not complete within {timeout} s "
          f"(distributed.initialization_timeout): process {topo.process_id} of "
          f"{topo.num_processes}, coordinator {topo.coordinator}")
  if topo.process_id != 0:
    why = rendezvous.probe(topo.coordinator)
    if why is not None:
      return (f"{head}: cannot reach the coordinator {topo.coordinator} ({why}). Is process 0 "
              "running there, is the host name/port right, and is the port open from this "
              "node?")
  return (f"{head}: not all {topo.num_processes} processes registered with the coordinator. "
          "A process did not start, or the processes disagree about the job (every process "
          f"needs the same coordinator and process count, and a distinct id in "
          f"[0, {topo.num_processes})). Settings here: {topo.describe_sources()}")


def _start_watchdog(topo: Topology, timeout: int) -> threading.Event:
  """Ends the process with :func:`_startup_failure` unless the returned event is set within
  ``timeout`` seconds."""
  done = threading.Event()

  def watch():
    if not done.wait(timeout):
      print(f"error: {_startup_failure(topo, timeout)}", file=sys.stderr, flush=True)
      os._exit(1)

  threading.Thread(target=watch, name="lmscale-init-watchdog", daemon=True).start()
  return done


def initialize(config) -> Topology:
  """Starts the JAX runtime for this process (a no-op for a single process); returns its place.

  Must run before anything initialises a JAX backend (``jax.devices()`` …), never at import
  time (Grain's worker processes re-import ``__main__``). After start-up, checks that all
  processes agree on the job and have the same number of devices; process 0 logs the topology.
  """
  dcfg = config.distributed
  topo = resolve(dcfg)
  if not topo.multi:
    if topo.local_device_ids:
      jax.config.update("jax_cuda_visible_devices", ",".join(map(str, topo.local_device_ids)))
    log_topology(topo)
    return topo
  if jax.distributed.is_initialized():
    return topo
  timeout = int(dcfg.initialization_timeout)
  if timeout <= 0 or int(dcfg.heartbeat_timeout) <= 0:
    raise DistributedError("distributed.initialization_timeout and heartbeat_timeout must be "
                           "positive (seconds)")
  supervisor.start(topo)  # forks: from here on this is the child (before any thread starts)
  # Collectives between CPU devices of different processes (tests, local.sh on CPU) need an
  # implementation: named explicitly rather than relying on this JAX version's default.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Its sync manager is how the processes agree on a step to checkpoint at when preempted
  # (Checkpointer.reached_preemption); on by default, required here.
  jax.config.update("jax_enable_preemption_service", True)
  done = _start_watchdog(topo, timeout)
  logging.info("process %d of %d: connecting to coordinator %s (%s)", topo.process_id,
               topo.num_processes, topo.coordinator, topo.describe_sources())
  try:
    # Nothing registers with a coordination service that is not this job's (see rendezvous).
    (rendezvous.claim if topo.process_id == 0 else rendezvous.confirm)(topo)
    jax.distributed.initialize(
        coordinator_address=topo.coordinator, num_processes=topo.num_processes,
        process_id=topo.process_id,
        local_device_ids=list(topo.local_device_ids) if topo.local_device_ids else None,
        cluster_detection_method="deactivate",  # topology.resolve did it, for both layouts
        initialization_timeout=timeout + _RUNTIME_GRACE_S,
        heartbeat_timeout_seconds=int(dcfg.heartbeat_timeout),
        shutdown_timeout_seconds=int(dcfg.shutdown_timeout))
  finally:
    done.set()
  _job.coordinator = topo.coordinator
  _check_job(topo)
  log_topology(topo)
  return topo


def _check_job(topo: Topology) -> None:
  """Every process declared the same job; every process has the same number of devices."""
  declared = [json.loads(x) for x in allgather("declared", json.dumps(
      {"n": topo.num_processes, "id": topo.process_id, "host": socket.gethostname(),
       "sources": topo.describe_sources()}), timeout_s=_JOB_CHECK_TIMEOUT_S)]
  _job.hosts = [d["host"] for d in declared]
  supervisor.report_hosts(_job.hosts)
  disagree = any(d["n"] != declared[0]["n"] or d["id"] != p for p, d in enumerate(declared))
  if disagree or jax.process_count() != topo.num_processes:
    lines = "; ".join(f"process {p} on {d['host']} says {d['n']} processes, id {d['id']} "
                      f"({d['sources']})" for p, d in enumerate(declared))
    raise DistributedError(f"the processes disagree about the job: {lines}")
  devices_per_process = collections.Counter(dev.process_index for dev in jax.devices())
  if len(set(devices_per_process.values())) != 1:
    desc = ", ".join(f"process {p}: {c}" for p, c in sorted(devices_per_process.items()))
    raise DistributedError(
        f"processes have different numbers of devices ({desc}); every process must drive the "
        "same number (local_device_ids / one task per GPU or per node, not a mix)")


def log_topology(topo: Topology) -> None:
  """Process 0 logs the job's shape once: processes × devices, the mesh, where from."""
  if jax.process_index() != 0:
    return
  devices = jax.devices()
  processes, per_process = jax.process_count(), jax.local_device_count()
  logging.info(
      "topology: %d process%s × %d %s device%s = %d global device%s; mesh {'data': %d}; %s",
      processes, "es" if processes > 1 else "", per_process, devices[0].platform,
      "s" if per_process > 1 else "", len(devices), "s" if len(devices) > 1 else "",
      len(devices), f"coordinator {topo.coordinator} ({topo.describe_sources()})"
      if topo.multi else "single process")


# --------------------------------------------------------------------------- agreement
def _client():
  # The runtime's key-value store client: jax.distributed has no public accessor for it.
  from jax._src import distributed as jax_distributed

  if jax_distributed.global_state.client is None:
    raise DistributedError("jax.distributed is not initialized")
  return jax_distributed.global_state.client


_exchange_round = collections.Counter()


def allgather(name: str, value: str, timeout_s: float = _DEFAULT_EXCHANGE_TIMEOUT_S) -> list[str]:
  """Every process's ``value`` (a string), in process order, via the coordinator's key-value
  store. Single process: ``[value]``. Every process must call it with the same ``name``s in
  the same order (a per-name counter keeps repeated names apart)."""
  if jax.process_count() == 1:
    return [value]
  _exchange_round[name] += 1
  key = f"lmscale/{name}/{_exchange_round[name]}"
  client = _client()
  client.key_value_set(f"{key}/{jax.process_index()}", value)
  values = []
  for p in range(jax.process_count()):
    try:
      values.append(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
    except Exception as e:  # the runtime raises a bare XlaRuntimeError on a deadline
      raise DistributedError(f"no answer from process {p} for {name!r} within {timeout_s:.0f} "
                             f"s: {e}") from e
  return values


def agree(name: str, fn: Callable[[], Any], timeout_s: float = _DEFAULT_EXCHANGE_TIMEOUT_S):
  """Runs ``fn`` in every process; if it fails anywhere, every process raises: the failing
  one its own error, the others one naming each failed process, its host and its error.

  Without this a check failing on one node only (its local dataset, its view of the workdir)
  would leave the other processes waiting in the first collective until the heartbeat
  timeout, with an error that names nothing.
  """
  try:
    result, error = fn(), None
  except Exception as e:  # re-raised below, identically in every process
    result, error = None, e
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return result
  mine = "" if error is None else f"{type(error).__name__}: {error}"
  answers = [json.loads(a) for a in allgather(
      f"agree/{name}", json.dumps({"error": mine, "host": socket.gethostname()}), timeout_s)]
  failed = [(p, answer) for p, answer in enumerate(answers) if answer["error"]]
  if failed:
    if error is not None and len(failed) == 1:
      raise error
    desc = "; ".join(f"process {p} on {answer['host']}: {answer['error']}"
                     for p, answer in failed)
    raise DistributedError(f"{name} failed in {len(failed)} of {jax.process_count()} "
                           f"processes: {desc}")
  return result


# --------------------------------------------------------------------------- exits
# A failed collective that says this: a peer's connection broke (gloo, NCCL) or the service is
# unreachable; the runtime then ends this process within the heartbeat timeout.
_PEER_FAILURE = re.compile(r"(?i)gloo|nccl|connection|socket|peer|unavailable|deadline|"
                           r"coordination|heartbeat")
# Beyond the heartbeat timeout: the service's check runs periodically, then it tells every task.
_VERDICT_GRACE_S = 10


def peer_failure(error: BaseException) -> bool:
  """Whether ``error`` is a collective of a multi-process job that failed because a peer's
  connection broke (the runtime then names the lost process: lmscale_jax.cluster.supervisor)."""
  return (not isinstance(error, UserError) and _job.coordinator is not None
          and bool(_PEER_FAILURE.search(str(error))))


def await_runtime(error: BaseException, heartbeat_timeout_s: float) -> None:
  """For a collective that failed because a peer may be gone: waits for the runtime to end
  this process (the supervisor then names the lost process) and returns only if it has not
  within ``heartbeat_timeout_s`` + grace. A user error, or one whose message does not say a
  peer is gone, returns at once. The message decides, not the type: a device collective raises
  JaxRuntimeError, a host-side one ValueError ("UNKNOWN: Gloo AllGather failed: … Connection
  closed by peer", seen in tests/test_finetune.py)."""
  if not peer_failure(error):
    return
  logging.info("a collective failed (%s); waiting for the runtime to name the lost process",
               str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
  time.sleep(heartbeat_timeout_s + _VERDICT_GRACE_S)


def exit_now(code: int = 1) -> None:
  """Ends a failed multi-process run at once, skipping JAX's shutdown barrier (its peers are
  blocked in a collective and would otherwise hold this process for ``shutdown_timeout``)."""
  if jax.distributed.is_initialized() and jax.process_index() == 0:
    # Process 0 hosts the coordination service: when it goes, the runtime aborts every other
    # process at once. A moment's wait lets peers that failed the same check print why.
    supervisor.flush_output()
    time.sleep(_COORDINATOR_LINGER_S)
  supervisor.leave(code)
