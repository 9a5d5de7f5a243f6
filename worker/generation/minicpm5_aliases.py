"""MiniCPM5's renamed calls, as vLLM's ``minicpm5`` tool parser renames them
(``_normalize_alias_tool_call``): names MiniCPM5 writes for τ²-bench's telecom functions
(``get_details_by_phone`` for ``get_customer_by_phone``, ``enable_roaming`` for
``toggle_roaming``...), each read as the request's function with its arguments renamed.

A call is renamed only where the request lacks the name written and has the function it
stands for, and only where the arguments give what the renamed call needs (a phone
number, an id...; else it stays as written, and so is no call). An argument is taken from
the first of its names that is set (vLLM's ``or``: an empty or zero value passes on to the
next name); the renamed call's arguments are those alone, as read, not typed again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

_BY_ID = ("get_line_details", "get_line_status", "get_roaming_status")
_REFUEL = ("add_refueled_data", "add_data_to_line")


def rename(name: str, args: Mapping[str, Any],
           names: Collection[str]) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """The call ``name(args)`` as the function among ``names`` it stands for (as written
    where none)."""
    if name in names:
        return name, dict(args)
    got = _renamed(name, args, names)
    return got if got is not None else (name, dict(args))


def _renamed(name: str, args: Mapping[str, Any],
             names: Collection[str]) -> tuple[str, dict[str, Any]] | None:  # fmt: skip
    if name == "get_details_by_phone" and "get_customer_by_phone" in names:
        phone = _first(args, "phone_number", "phone")
        return None if phone is None else ("get_customer_by_phone", {"phone_number": phone})
    if name == "get_details_by_name" and "get_customer_by_name" in names:
        full_name, dob = _first(args, "full_name", "name"), _first(args, "date_of_birth", "dob")
        by_name = {} if full_name is None else {"full_name": full_name}
        if dob is not None:
            by_name |= {"date_of_birth": dob, "dob": dob}
        return ("get_customer_by_name", by_name) if by_name else None
    if name in (*_BY_ID, "get_plan_details") and "get_details_by_id" in names:
        some_id = _first(args, "plan_id" if name == "get_plan_details" else "line_id", "id")
        return None if some_id is None else ("get_details_by_id", {"id": some_id})
    if name in ("enable_roaming", "disable_roaming") and "toggle_roaming" in names:
        line = _first(args, "line_id", "id")
        on = name == "enable_roaming"
        return None if line is None else ("toggle_roaming", {"line_id": line, "enabled": on})
    if name in _REFUEL and "refuel_data" in names:
        line = _first(args, "line_id", "id")
        amount = _first(args, "amount_gb", "gb", "gb_amount", "amount")
        refuel = {"customer_id": args["customer_id"]} if "customer_id" in args else {}
        refuel |= {} if line is None else {"line_id": line}
        refuel |= {} if amount is None else {"amount_gb": amount}
        return ("refuel_data", refuel) if refuel else None
    return None


def _first(args: Mapping[str, Any], *keys: str) -> Any:
    """The first of ``keys``' values that is set (truthy), else the last's (vLLM's
    ``args.get(a) or args.get(b)``)."""
    got = None
    for key in keys:
        got = args.get(key)
        if got:
            return got
    return got
