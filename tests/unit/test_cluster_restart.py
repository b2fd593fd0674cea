"""The local launcher's restart of a dead service when the service was scaled away
while it waited out its backoff (`rlfleet scale rollout` during a restart): nothing is
restarted or counted, and nothing raises (the supervisor thread used to die on it,
and no service was restarted after that)."""

from __future__ import annotations

from pathlib import Path

from rlfleet.common.config import config_from_dict
from rlfleet.launch.cluster import LocalCluster, _Proc


def test_a_replica_retired_during_its_backoff_is_not_restarted(tmp_path: Path) -> None:
    config = config_from_dict(
        {
            "actor": {"model_path": "m"},
            "services": {"restart_backoff_s": 0.05},
            "trainer": {"default_local_dir": str(tmp_path / "run")},
        }
    )
    cluster = LocalCluster(config, tmp_path / "run", scheduler=False)
    retired = _Proc("rollout-2", "rollout", ["rlfleet.rollout.server"], {}, (0,), None,
                    tmp_path / "rollout-2.log", address="127.0.0.1:9")  # fmt: skip
    assert retired not in cluster._procs  # _retire took it out meanwhile
    cluster._restart(retired, -9, 0)
    assert cluster.restarts == {} and cluster.events["restarted"] == 0
    assert cluster._procs == []
