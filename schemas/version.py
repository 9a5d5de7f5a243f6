"""The protocol's version (every message's ``v``) and its encodings (a request's and a
result's ``format``): what each message of the wire states about itself."""

from __future__ import annotations

from typing import Final, Literal

SCHEMA_VERSION: Final = 1
Format = Literal["msgpack", "json"]
