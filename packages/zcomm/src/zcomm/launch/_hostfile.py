"""Which slots of which hosts a launch runs on: DeepSpeed's hostfile, ``--include`` and
``--exclude``, and the world info each node is given. Pure functions over strings and dicts.

A hostfile is DeepSpeed's (MPI's) ``HOST slots=N`` per line; ``#`` starts a comment. A node
spec is ``NAME[:SLOT[,SLOT...]][@NAME[:SLOT...]...]``: a host alone means all its slots.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "DLTS_HOSTFILE",
    "LaunchError",
    "decode_world_info",
    "encode_world_info",
    "parse_hostfile",
    "parse_inclusion_exclusion",
    "parse_node_spec",
    "read_hostfile",
]

DLTS_HOSTFILE = "/job/hostfile"  # DeepSpeed's default hostfile

# 'HOST slots=N', then anything MPI allows after it (max_slots=...), as DeepSpeed reads it
_LINE = re.compile(r"(\S+)\s+slots=(\d+)(?:\s.*)?")


class LaunchError(ValueError):
    """A launch cannot start as asked: the message names the argument or line at fault."""


def parse_hostfile(lines: Iterable[str], source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` in the file's order from ``HOST slots=N`` lines.

    Blank lines and ``#`` comments (whole lines or trailing) are skipped. A line of another
    shape, a host listed twice, ``slots=0`` or a file with no hosts raises `LaunchError`
    naming ``source`` and the line number.
    """
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise LaunchError(
                f"{source}:{number}: expected 'HOST slots=N' (e.g. 'worker-0 slots=8'), "
                f"got {raw.strip()!r}"
            )
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LaunchError(
                f"{source}:{number}: host {host!r} is listed again (first on line "
                f"{first_line[host]}); give each host one line"
            )
        if slots < 1:
            raise LaunchError(f"{source}:{number}: host {host!r} has slots={slots}; need >= 1")
        pool[host] = slots
        first_line[host] = number
    if not pool:
        raise LaunchError(f"{source} lists no hosts (expected lines 'HOST slots=N')")
    return pool


def read_hostfile(path: str | Path) -> dict[str, int] | None:
    """`parse_hostfile` of the file at ``path``, or ``None`` when there is no such file."""
    file = Path(path)
    if not file.is_file():
        return None
    return parse_hostfile(file.read_text().splitlines(), source=str(file))


def parse_node_spec(spec: str, flag: str = "--include") -> dict[str, list[int]]:
    """``{host: sorted slots}`` from ``NAME[:SLOT[,SLOT...]]@...``; ``[]`` means every slot.

    A host named twice has its slots merged (as DeepSpeed does). An empty part, a slot that is
    not a non-negative integer or a second ``:`` raises `LaunchError` naming ``flag``.
    """
    nodes: dict[str, set[int]] = {}
    whole: set[str] = set()
    for part in spec.split("@"):
        name, colon, slots = part.strip().partition(":")
        if not name:
            raise LaunchError(f"{flag} {spec!r}: empty host name in {part!r}")
        chosen = nodes.setdefault(name, set())
        if not colon:
            whole.add(name)
            continue
        for slot in slots.split(","):
            if not slot.strip().isdigit():
                raise LaunchError(
                    f"{flag} {spec!r}: slot {slot!r} of host {name!r} is not a non-negative "
                    "integer (format: NAME[:SLOT[,SLOT...]][@NAME...])"
                )
            chosen.add(int(slot))
    # a host named alone anywhere in the spec means all of its slots
    return {name: [] if name in whole else sorted(slots) for name, slots in nodes.items()}


def _slot_lists(pool: Mapping[str, int | Sequence[int]]) -> dict[str, list[int]]:
    return {
        host: list(range(slots)) if isinstance(slots, int) else list(slots)
        for host, slots in pool.items()
    }


def _check_slots(pool: Mapping[str, list[int]], spec: Mapping[str, list[int]], flag: str) -> None:
    for host, slots in spec.items():
        if host not in pool:
            raise LaunchError(
                f"{flag} names host {host!r}, which the hostfile does not list "
                f"(hosts: {', '.join(pool) or 'none'})"
            )
        bad = [slot for slot in slots if slot not in pool[host]]
        if bad:
            raise LaunchError(
                f"{flag} asks for slot(s) {bad} of host {host!r}, which has slots {pool[host]}"
            )


def parse_inclusion_exclusion(
    pool: Mapping[str, int | Sequence[int]], include: str = "", exclude: str = ""
) -> dict[str, list[int]]:
    """The slots to run on, ``{host: [slot, ...]}`` in the pool's host order.

    ``pool`` gives each host's slot count (a hostfile's) or its slots. With neither filter,
    every slot of every host. ``include`` keeps only the named hosts (and slots), ``exclude``
    drops them; hosts left with no slot are dropped (the result may be empty). Both filters at
    once, or a host or slot the pool lacks, raises `LaunchError`.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; give one")
    active = _slot_lists(pool)
    checked = dict(active)
    if include:
        spec = parse_node_spec(include, "--include")
        _check_slots(checked, spec, "--include")
        active = {host: spec[host] or slots for host, slots in active.items() if host in spec}
    elif exclude:
        spec = parse_node_spec(exclude, "--exclude")
        _check_slots(checked, spec, "--exclude")
        for host, slots in spec.items():
            active[host] = [slot for slot in active[host] if slots and slot not in slots]
    return {host: slots for host, slots in active.items() if slots}


def encode_world_info(world_info: Mapping[str, list[int]]) -> str:
    """The world info (``{host: slots}`` in node order) as DeepSpeed passes it to each node:
    URL-safe base64 of its JSON."""
    return base64.urlsafe_b64encode(json.dumps(dict(world_info)).encode()).decode()


def decode_world_info(encoded: str) -> dict[str, list[int]]:
    """The inverse of `encode_world_info`; anything else raises `LaunchError`."""
    try:
        value = json.loads(base64.urlsafe_b64decode(encoded.encode()))
    except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LaunchError(
            f"--world_info {encoded!r} is not base64 of a JSON object: {error}"
        ) from error
    if (
        not isinstance(value, dict)
        or not value
        or not all(
            isinstance(slots, list) and slots and all(isinstance(s, int) for s in slots)
            for slots in value.values()
        )
    ):
        raise LaunchError(
            f"--world_info decodes to {value!r}, not a non-empty {{host: [slot, ...]}}"
        )
    return {str(host): list(slots) for host, slots in value.items()}
