"""Shared by the launcher tests: a config whose multi-turn tools are the run's tools
service, and the check that a launcher started it and told the replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def with_tools_service(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with multi-turn rollouts whose tools are the run's tools service (a
    launcher starts it) serving the built-in calculator."""
    rollout = {**raw.get("rollout", {})}
    rollout["multi_turn"] = {"enable": True, "tools": [{"kind": "service"}]}
    return {**raw, "rollout": rollout, "tools": {"builtin": ["calculator"]}}


def check_tools_service(handle: Any, rollout_pid: int) -> None:
    """The launched tools service answers (with the cluster's credentials, this
    process's) and the replica was given its address."""
    from rlfleet.tools.client import RemoteToolClient

    assert handle.tools
    client = RemoteToolClient(handle.tools)
    try:
        assert [t.name for t in client.list_tools()] == ["calculator"]
        assert client.call("calculator", '{"expression": "6 * 7"}', timeout_s=10).content == "42"
    finally:
        client.close()
    argv = Path(f"/proc/{rollout_pid}/cmdline").read_bytes().split(b"\0")
    assert f"services.tools={handle.tools}".encode() in argv
