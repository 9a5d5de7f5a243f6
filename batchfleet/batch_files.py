"""Where ``batchfleet run-batch`` reads and writes, as vLLM's ``run-batch``: a local file,
``-`` (stdin, stdout), or an http(s) URL: read with GET as it streams; written to a
temporary file (in ``--output-tmp-dir``) and uploaded with PUT once whole."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import IO, Final

logger = logging.getLogger(__name__)

UPLOAD_TRIES: Final = 5
UPLOAD_DELAY_S: Final = 5.0
"""An upload is tried 5 times, 5 s apart (vLLM's)."""
HTTP_TIMEOUT_S: Final = 1000.0
"""Seconds an input read or an upload may stall (vLLM's upload timeout)."""


class UploadFailed(OSError):
    """The output could not be uploaded; it is kept in a local file (``path``)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


def open_input(source: str) -> IO[str]:
    """The input's text stream (UTF-8); ``OSError`` (``URLError`` for a URL) where it
    cannot be opened."""
    if source == "-":
        return sys.stdin
    if is_url(source):
        response = urllib.request.urlopen(source, timeout=HTTP_TIMEOUT_S)
        return io.TextIOWrapper(response, encoding="utf-8")
    return open(source, encoding="utf-8")


async def lines_of(stream: IO[str]) -> AsyncIterator[str]:
    """``stream``'s lines, each read in a thread: stdin and a URL may block."""
    while line := await asyncio.to_thread(stream.readline):
        yield line


@contextlib.contextmanager
def output(destination: str, tmp_dir: str | None = None) -> Iterator[IO[str]]:
    """A text stream for the output lines: stdout (``-``), the file (truncated), or, for a
    URL, a temporary file in ``tmp_dir`` uploaded with PUT when the block ends, then
    removed (kept where the upload fails: :class:`UploadFailed` names it; kept and not
    uploaded where the block raises, as a stopped run does, and kept where the upload is
    stopped (Ctrl-C): the log names it)."""
    if destination == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    if not is_url(destination):
        with open(destination, "w", encoding="utf-8") as f:
            yield f
        return
    fd, path = tempfile.mkstemp(prefix="tmp_batch_output_", suffix=".jsonl", dir=tmp_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        try:
            yield f
        except BaseException:  # stopped (Ctrl-C) or failed: nothing is uploaded
            logger.warning("run-batch: not uploaded to %s; the output so far is kept in %s",
                           destination, path)  # fmt: skip
            raise
    try:
        upload(destination, path)
    except KeyboardInterrupt:  # stopped between tries: the whole output stays, named
        logger.warning("run-batch: upload to %s stopped; the output is kept in %s",
                       destination, path)  # fmt: skip
        raise
    os.unlink(path)


def upload(url: str, path: str) -> None:
    """PUT the file at ``path`` to ``url`` (a status other than 2xx is a failure), tried
    :data:`UPLOAD_TRIES` times :data:`UPLOAD_DELAY_S` apart."""
    tries, delay_s = UPLOAD_TRIES, UPLOAD_DELAY_S
    for attempt in range(1, tries + 1):
        try:
            with open(path, "rb") as data:
                request = urllib.request.Request(url, data=data, method="PUT", headers={
                    "Content-Length": str(os.path.getsize(path)),
                    "Content-Type": "application/jsonl"})  # fmt: skip
                with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                    if 200 <= response.status < 300:
                        logger.info("run-batch: output uploaded to %s", url)
                        return
                    raise OSError(f"HTTP {response.status}")
        except OSError as exc:  # URLError and HTTPError are OSErrors
            if attempt == tries:
                raise UploadFailed(f"uploading to {url} failed {tries} times ({exc}); the "
                                   f"output is kept in {path}", path) from exc  # fmt: skip
            logger.warning("run-batch: upload %d to %s failed (%s); again in %g s", attempt,
                           url, exc, delay_s)  # fmt: skip
            time.sleep(delay_s)
