"""Reading a Chrome-trace timeline file back, for the timeline tests."""

from __future__ import annotations

import json


def load(path) -> list[dict]:
    """The events of the timeline file at ``path``."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def rows(events: list[dict]) -> dict[str, int]:
    """Row name -> pid, from the process_name metadata (pid 0 is the header row)."""
    return {e["args"]["name"]: e["pid"] for e in events
            if e["ph"] == "M" and e["name"] == "process_name" and e["pid"] != 0}


def phases(events: list[dict], pid: int) -> list[tuple[str, str | None]]:
    """``(phase, name)`` of row ``pid``'s events, metadata left out."""
    return [(e["ph"], e.get("name")) for e in events if e["pid"] == pid and e["ph"] != "M"]


def assert_well_formed(events: list[dict], ordered: bool = True) -> None:
    """Begin/end events pair up (nesting) per row; with ``ordered``, time never goes back
    on a row."""
    stacks: dict[int, list[str]] = {}
    last_ts: dict[int, int] = {}
    for e in events:
        if e["ph"] == "M":
            continue
        if ordered:
            assert isinstance(e["ts"], int) and e["ts"] >= last_ts.get(e["pid"], 0), e
            last_ts[e["pid"]] = e["ts"]
        if e["ph"] == "B":
            stacks.setdefault(e["pid"], []).append(e["name"])
        elif e["ph"] == "E":
            assert stacks.get(e["pid"]), f"end without begin on row {e['pid']}: {e}"
            stacks[e["pid"]].pop()
    assert all(not s for s in stacks.values()), f"unclosed phases: {stacks}"
