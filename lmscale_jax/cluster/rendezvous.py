"""Before the runtime starts: process 0 claims the coordinator's port, the others check that the
process listening there is their own job's process 0.

Why: the coordination service of ``jax.distributed`` binds its port with ``SO_REUSEPORT``
(gRPC's default), so a second job whose port is the same (two Slurm jobs whose derived ports
collide, a port given twice) starts a second service beside the first instead of failing, and
its process 1, registering with whichever service the kernel picks, makes the first job's
service abort that job ("unexpectedly tried to connect with a different incarnation"). JAX has
no job name to tell them apart, so this module does it before any process registers:

* process 0 (:func:`claim`) binds the port with a plain socket first: taken -> one error naming
  the port, the host and ``LMSCALE_COORDINATOR_PORT`` (nothing was started, so the job holding
  it is unharmed). It then answers each peer's hello (``lmscale-hello <job> <id>``) and, once
  every peer has said hello, tells them all to go, closes the socket and starts the service
  (``distributed.initialize``);
* every other process (:func:`confirm`) connects and says hello until process 0 answers:
  ``lmscale-go`` -> start the runtime; an answer from a different job (its ``job`` key,
  ``topology.job_key``) or from something that is not process 0 in this phase (another job's
  running service answers a hello with HTTP/2 bytes or closes) -> one error, without ever
  registering with that service.

A refused connection means process 0 is not listening yet: the peer retries. The overall time
is bounded by the start-up watchdog (``distributed.initialization_timeout``).
"""

from __future__ import annotations

import errno
import resource
import socket
import time

from lmscale_jax.cluster.topology import DistributedError, ENV_COORDINATOR_PORT, Topology

_HELLO, _GO, _OTHER = "lmscale-hello", "lmscale-go", "lmscale-other"
_RETRY_S = 0.2
_READ_TIMEOUT_S = 5.0  # a hello is one line, sent at once after connecting


def _split(address: str) -> tuple[str, int]:
  host, port = address.rsplit(":", 1)
  return host.strip("[]"), int(port)


def probe(address: str, timeout: float = 2.0) -> str | None:
  """None when a TCP connection to ``host:port`` succeeds, else the reason."""
  try:
    with socket.create_connection(_split(address), timeout=timeout):
      return None
  except OSError as e:
    return e.strerror or str(e)


def _listen(port: int) -> socket.socket:
  """A listening socket on every address at ``port``; EADDRINUSE if something listens there.

  ``socket.create_server`` sets SO_REUSEADDR (a previous run's TIME_WAIT connections do not
  count as taken) but not SO_REUSEPORT, so it conflicts with a listening gRPC server."""
  if socket.has_dualstack_ipv6():
    return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                backlog=1024)
  return socket.create_server(("", port), backlog=1024)


def _port_taken(topo: Topology, port: int) -> DistributedError:
  return DistributedError(
      f"coordinator port {port} on {socket.gethostname()} is already in use (another job's "
      f"coordinator, or another program; coordinator {topo.coordinator} from "
      f"{topo.sources.get('coordinator', '?')}): process 0 did not start, so that job is "
      f"unharmed. Set {ENV_COORDINATOR_PORT} to a free port for this job (the same for every "
      "task), or --config.distributed.coordinator=host:port")


def _allow_files(count: int) -> None:
  """One open connection per peer until all have said hello: raise the soft file limit."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = count + 256
  if soft != resource.RLIM_INFINITY and soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def _read_line(conn: socket.socket, timeout: float) -> str:
  conn.settimeout(timeout)
  data = b""
  try:
    while b"\n" not in data and len(data) < 512:
      chunk = conn.recv(512)
      if not chunk:
        break
      data += chunk
  except OSError:
    pass
  return data.split(b"\n", 1)[0].decode("utf-8", "replace").strip()


def claim(topo: Topology) -> None:
  """Process 0: bind the coordinator's port (taken -> :class:`DistributedError`), wait for a
  hello from every other process of this job, tell them to go, release the port."""
  _, port = _split(topo.coordinator)
  try:
    server = _listen(port)
  except OSError as e:
    if e.errno == errno.EADDRINUSE:
      raise _port_taken(topo, port) from None
    raise DistributedError(f"process 0 cannot listen on coordinator port {port} on "
                           f"{socket.gethostname()}: {e.strerror or e}; set "
                           f"{ENV_COORDINATOR_PORT} to a free port above 1023") from e
  _allow_files(topo.num_processes)
  waiting: dict[int, socket.socket] = {}  # process id -> its open connection
  try:
    while len(waiting) < topo.num_processes - 1:
      conn, _ = server.accept()
      words = _read_line(conn, _READ_TIMEOUT_S).split(" ")
      if len(words) == 3 and words[0] == _HELLO and words[1] == (topo.job or "-"):
        pid = int(words[2]) if words[2].isdigit() else -1
        if 0 < pid < topo.num_processes and pid not in waiting:
          waiting[pid] = conn
          continue
      # Another job's process, a duplicate id, or not our protocol at all (a client that
      # connected early): it learns who holds the port and this job goes on waiting.
      _send(conn, f"{_OTHER} {topo.job or '-'} {socket.gethostname()}\n")
      conn.close()
    for conn in waiting.values():
      _send(conn, f"{_GO}\n")
  finally:
    for conn in waiting.values():
      conn.close()
    server.close()


def _send(conn: socket.socket, text: str) -> None:
  try:
    conn.sendall(text.encode())
  except OSError:
    pass  # the peer gave up: its own error says why


def confirm(topo: Topology) -> None:
  """Any other process: say hello to process 0 until it answers go (refused: retry); an answer
  from anything else is a :class:`DistributedError` and this process never registers there."""
  host, port = _split(topo.coordinator)
  hello = f"{_HELLO} {topo.job or '-'} {topo.process_id}\n".encode()
  while True:
    try:
      conn = socket.create_connection((host, port), timeout=_READ_TIMEOUT_S)
    except OSError:
      time.sleep(_RETRY_S)  # not listening yet (or not reachable: the watchdog says which)
      continue
    with conn:
      try:
        conn.sendall(hello)
      except OSError:
        time.sleep(_RETRY_S)
        continue
      # Process 0 answers only when every peer is in: wait as long as start-up may take.
      answer = _read_line(conn, timeout=None)
    if answer == _GO:
      return
    if answer.startswith(_OTHER):
      words = answer.split(" ")
      raise DistributedError(
          f"process {topo.process_id}: the coordinator {topo.coordinator} is held by another "
          f"job (job {words[1] if len(words) > 1 else '?'} on "
          f"{words[2] if len(words) > 2 else '?'}), or two processes of this job claim id "
          f"{topo.process_id}. Set {ENV_COORDINATOR_PORT} to a free port for this job, or "
          "check the process ids")
    raise DistributedError(
        f"process {topo.process_id}: the coordinator address {topo.coordinator} answers, but "
        "not as this job's process 0 (another job's running coordinator, or another program, "
        f"holds the port); this process did not register there. Set {ENV_COORDINATOR_PORT} to "
        "a free port for this job (the same for every task)")
