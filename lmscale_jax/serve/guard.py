"""The server's outer wall, one ASGI middleware around every request: the access token, the
request-size cap, and the last word on an unexpected exception (500 with one line, the
traceback in the server's log, the server still up). Every error body is ``{"error": line}``."""

from __future__ import annotations

import hmac
import json
import logging

log = logging.getLogger("lmscale.serve")

# A body over the limit with a declared length is read and dropped (up to this much) before the
# 413 goes out: a server that closes a socket with unread data sends a TCP reset, and the client
# that is still sending its upload then loses the 413 it was answered with.
DRAIN_BYTES = 256 << 20


class ApiError(Exception):
  """A request the API refuses: its HTTP status and the one line the client reads."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status, self.message = status, message


async def send_error(send, status: int, message: str, headers: tuple = ()) -> None:
  body = json.dumps({"error": message}).encode()
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode()), *headers]})
  await send({"type": "http.response.body", "body": body})


def too_large(size: int | None, limit: int) -> str:
  """``size``: the declared length (None: a body sent without one, cut where it passed)."""
  what = f"request body of {size} bytes is" if size is not None else "request body is"
  return f"{what} over the server's limit of {limit} bytes (lmscale serve --max-upload-mb)"


class Guard:
  """``token``: when set, every /api/* request needs ``Authorization: Bearer TOKEN`` (compared
  in constant time); ``max_body``: bytes of one request body, checked on its Content-Length
  before any is read, and on the bytes as they arrive."""

  def __init__(self, app, token: str | None, max_body: int):
    self.app, self.token, self.max_body = app, token, max_body

  def authorised(self, scope) -> bool:
    if not self.token or not scope["path"].startswith("/api/"):
      return True
    given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    scheme, _, value = given.partition(" ")
    return hmac.compare_digest(value.strip().encode(), self.token.encode()) and (
        scheme.lower() == "bearer")

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    if not self.authorised(scope):
      return await send_error(send, 401, "missing or wrong access token: send the header "
                              "'Authorization: Bearer TOKEN' (the page: open it as /#token=TOKEN)",
                              ((b"www-authenticate", b"Bearer"),))
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > self.max_body:
      await drain(receive, int(declared))
      return await send_error(send, 413, too_large(int(declared), self.max_body))
    await self.guarded(scope, self.capped(receive), send)

  def capped(self, receive):
    received = 0

    async def receive_capped():
      nonlocal received
      message = await receive()
      received += len(message.get("body", b""))
      if received > self.max_body:
        raise ApiError(413, too_large(None, self.max_body))
      return message

    return receive_capped

  async def guarded(self, scope, receive, send):
    started = False

    async def send_tracked(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, receive, send_tracked)
    except ApiError as e:  # the body cap, raised while a handler read the body
      if not started:
        await send_error(send, e.status, e.message)
    except Exception as e:  # a bug: logged with its traceback, one line to the client
      log.exception("%s %s failed", scope.get("method"), scope.get("path"))
      if not started:
        await send_error(send, 500, f"internal error ({type(e).__name__}) in "
                         f"{scope.get('path')}; the server's log has the traceback")


async def drain(receive, declared: int) -> None:
  """Reads and drops a refused body (see DRAIN_BYTES)."""
  seen = 0
  while seen <= min(declared, DRAIN_BYTES):
    message = await receive()
    seen += len(message.get("body", b""))
    if message["type"] != "http.request" or not message.get("more_body"):
      return
